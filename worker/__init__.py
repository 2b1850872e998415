"""rpcdist-worker."""

def main() -> None:
    print("worker")
