"""Settings of torch's multi-process test machinery for this package's tests.

torch's ``MultiProcessTestCase`` gives up on workers after ``DISTRIBUTED_TESTS_DEFAULT_TIMEOUT``
seconds (read when ``torch.testing._internal.common_distributed`` is imported): it then fetches
each hung worker's stack through its pipe, kills the workers and fails the test. 60 s is far
more than any of these tests needs, and less than the pytest-timeout of each test module, so a
hang is reported by torch's machinery, with the stacks.
"""

import os

os.environ.setdefault("DISTRIBUTED_TESTS_DEFAULT_TIMEOUT", "60")
