"""Who may talk to a worker or a store: the job's shared token, TLS credentials, and the
owner-only file that hands a generated token to the members of a single-host job.

A :class:`Security` is resolved once per process role from, in order, explicit arguments
(``RpcBackendOptions(auth_token=..., tls_cert=...)``, ``init_process_group(auth_token=...)``,
the programs' flags) and the environment (``RPCDIST_AUTH_TOKEN``, ``RPCDIST_AUTH_TOKEN_FILE``,
``RPCDIST_TLS_CERT``, ``RPCDIST_TLS_KEY``, ``RPCDIST_TLS_CA``). It is then used by

- gRPC servers (the store, the workers' Exchange service): TLS/mTLS credentials on the port
  and :func:`server_interceptors`, which refuse a call without the token with
  ``UNAUTHENTICATED`` before its handler runs or a byte of its request is decoded;
- gRPC clients: :meth:`Security.channel` (TLS credentials) and :meth:`Security.metadata`,
  sent with every call/stream (checked once per stream, not per message);
- framed sockets (Unix, ``transport="tcp"``): :meth:`Security.hello` is the first thing a
  client writes, :meth:`Security.admits` checks it before any frame is decoded.

Tokens are compared with :func:`hmac.compare_digest` and never logged; ``repr`` hides them.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import hmac
import logging
import os
import secrets
import ssl
import stat
import tempfile
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import grpc

log = logging.getLogger(__name__)

__all__ = [
    "Security",
    "TOKEN_ENV",
    "TOKEN_FILE_ENV",
    "TLS_CERT_ENV",
    "TLS_KEY_ENV",
    "TLS_CA_ENV",
    "METADATA_KEY",
    "HELLO_BYTES",
    "VERDICT_BYTES",
    "ACCEPTED",
    "REFUSED",
    "server_interceptors",
    "add_arguments",
    "from_arguments",
    "to_environment",
    "job_token_path",
    "new_token",
    "job_token_for",
    "publish_job_token",
    "read_job_token",
    "withdraw_job_token",
    "private_directory",
]

TOKEN_ENV = "RPCDIST_AUTH_TOKEN"
TOKEN_FILE_ENV = "RPCDIST_AUTH_TOKEN_FILE"
TLS_CERT_ENV = "RPCDIST_TLS_CERT"
TLS_KEY_ENV = "RPCDIST_TLS_KEY"
TLS_CA_ENV = "RPCDIST_TLS_CA"

METADATA_KEY = "rpcdist-auth"
"""The gRPC metadata key that carries the token."""

_MAGIC = b"RPCDIST\x01"
HELLO_BYTES = len(_MAGIC) + hashlib.sha256().digest_size
"""Length of the hello a socket client sends first: magic + SHA-256 of the token."""
ACCEPTED = b"RPCD-OK\x00"
REFUSED = b"RPCD-NO\x00"
VERDICT_BYTES = len(ACCEPTED)
"""The server's first bytes on a socket: whether it admitted the client's hello."""

# gRPC methods anyone may call: the health service says only whether a server serves, and
# reflection only which (public) services it has; neither reads nor changes anything.
_OPEN_METHODS = ("/grpc.health.v1.Health/", "/grpc.reflection.v1alpha.ServerReflection/")


def _read_text(path: str, what: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise ValueError(f"cannot read the {what} {path!r}: {exc.strerror or exc}") from None


def _check_token(token: str, source: str) -> str:
    token = token.strip()
    if not token:
        raise ValueError(f"the auth token from {source} is empty")
    if not token.isascii() or not token.isprintable() or " " in token:
        raise ValueError(f"the auth token from {source} must be printable ASCII without spaces")
    return token


def token_from_file(path: str) -> str:
    """The token in file ``path`` (surrounding whitespace stripped); warns if others can read it."""
    token = _read_text(path, "auth token file").decode("ascii", errors="replace")
    try:
        if os.stat(path).st_mode & 0o077:
            log.warning("the auth token file %s can be read by other users: chmod 600 it", path)
    except OSError:
        pass
    return _check_token(token, f"file {path}")


@dataclasses.dataclass(frozen=True)
class Security:
    """The credentials of one process role: a shared token and/or TLS files (all optional).

    ``tls_cert``/``tls_key`` are this side's PEM certificate chain and key (a server needs
    both to serve TLS); ``tls_ca`` the CA peers are verified against: given to a server, it
    requires and verifies client certificates (mTLS); given to a client, it verifies the server.
    """

    token: str | None = dataclasses.field(default=None, repr=False)
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None

    def __post_init__(self) -> None:
        if self.token is not None:
            object.__setattr__(self, "token", _check_token(self.token, "the arguments"))
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("TLS needs both a certificate (tls_cert) and its key (tls_key), or neither")

    def __repr__(self) -> str:
        token = "set" if self.token else "none"
        files = f"tls_cert={self.tls_cert!r}, tls_key={self.tls_key!r}, tls_ca={self.tls_ca!r}"
        return f"Security(token={token}, {files})"

    @classmethod
    def resolve(
        cls,
        auth_token: str | None = None,
        tls_cert: str | None = None,
        tls_key: str | None = None,
        tls_ca: str | None = None,
        *,
        auth_token_file: str | None = None,
        env: Mapping[str, str] | None = None,
    ) -> Security:
        """Explicit values first, then ``RPCDIST_AUTH_TOKEN``/``RPCDIST_AUTH_TOKEN_FILE`` and
        ``RPCDIST_TLS_CERT/KEY/CA`` from ``env`` (default: ``os.environ``)."""
        env = os.environ if env is None else env
        token = auth_token
        if token is None and auth_token_file:
            token = token_from_file(auth_token_file)
        if token is None and env.get(TOKEN_ENV):
            token = _check_token(env[TOKEN_ENV], f"${TOKEN_ENV}")
        if token is None and env.get(TOKEN_FILE_ENV):
            token = token_from_file(env[TOKEN_FILE_ENV])
        return cls(
            token,
            tls_cert or env.get(TLS_CERT_ENV) or None,
            tls_key or env.get(TLS_KEY_ENV) or None,
            tls_ca or env.get(TLS_CA_ENV) or None,
        )

    def with_token(self, token: str | None) -> Security:
        return dataclasses.replace(self, token=token)

    # -- TLS ------------------------------------------------------------------------------------
    @property
    def tls(self) -> bool:
        """Whether gRPC channels and servers use TLS (a CA alone suffices for a client)."""
        return bool(self.tls_cert or self.tls_ca)

    def server_credentials(self) -> grpc.ServerCredentials:
        if not (self.tls_cert and self.tls_key):
            raise ValueError("serving TLS needs tls_cert and tls_key")
        pair = (_read_text(self.tls_key, "TLS key"), _read_text(self.tls_cert, "TLS certificate"))
        ca = _read_text(self.tls_ca, "TLS CA certificate") if self.tls_ca else None
        return grpc.ssl_server_credentials([pair], root_certificates=ca, require_client_auth=ca is not None)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        ca = _read_text(self.tls_ca, "TLS CA certificate") if self.tls_ca else None
        key = _read_text(self.tls_key, "TLS key") if self.tls_key else None
        chain = _read_text(self.tls_cert, "TLS certificate") if self.tls_cert else None
        return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=chain)

    def add_port(self, server: grpc.aio.Server, address: str) -> int:
        """Bind ``address`` on ``server`` (TLS when configured); returns the port (0: failed)."""
        if self.tls:
            return server.add_secure_port(address, self.server_credentials())
        return server.add_insecure_port(address)

    def channel(self, target: str, options: Sequence[tuple[str, Any]] | None = None) -> grpc.aio.Channel:
        """A ``grpc.aio`` channel to ``target``, over TLS when configured."""
        if self.tls:
            return grpc.aio.secure_channel(target, self.channel_credentials(), options=options)
        return grpc.aio.insecure_channel(target, options=options)

    def ssl_context(self, server_side: bool) -> ssl.SSLContext | None:
        """The TLS context of a framed TCP link (None without TLS)."""
        if not self.tls:
            return None
        if server_side:
            context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=self.tls_ca)
            context.verify_mode = ssl.CERT_REQUIRED if self.tls_ca else ssl.CERT_NONE
        else:
            context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=self.tls_ca)
        if self.tls_cert and self.tls_key:
            context.load_cert_chain(self.tls_cert, self.tls_key)
        return context

    # -- the token ------------------------------------------------------------------------------
    def metadata(self) -> tuple[tuple[str, str], ...]:
        """The call metadata that carries the token (empty without one)."""
        return ((METADATA_KEY, self.token),) if self.token else ()

    def hello(self) -> bytes:
        """What a socket client writes first (a digest, so the token has a fixed length)."""
        return _MAGIC + hashlib.sha256((self.token or "").encode()).digest()

    def admits(self, hello: bytes) -> bool:
        """Whether a socket client's ``hello`` carries this side's token (any, without one)."""
        if not hello.startswith(_MAGIC) or len(hello) != HELLO_BYTES:
            return False
        if not self.token:
            return True
        return hmac.compare_digest(hello[len(_MAGIC) :], hashlib.sha256(self.token.encode()).digest())

    def admits_metadata(self, metadata: Sequence[Any] | None) -> bool:
        if not self.token:
            return True
        expected = self.token.encode()
        for key, value in metadata or ():
            if key == METADATA_KEY:
                given = value.encode() if isinstance(value, str) else bytes(value)
                return hmac.compare_digest(given, expected)
        return False


class _TokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call whose metadata lacks the token, before its handler runs: the
    replacement handler decodes nothing and answers UNAUTHENTICATED."""

    def __init__(self, security: Security, what: str) -> None:
        self._security = security
        self.what = what  # named in refusals (set again once the port is known)
        self._refused = 0

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Any],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        method = details.method or ""
        if method.startswith(_OPEN_METHODS) or self._security.admits_metadata(details.invocation_metadata):
            return await continuation(details)
        handler = await continuation(details)
        if handler is None:
            return None
        self._refused += 1
        if self._refused <= 3 or self._refused % 1000 == 0:  # never the token; bounded noise
            log.warning(
                "%s refused a call to %s: missing or wrong auth token (%d so far)",
                self.what,
                method,
                self._refused,
            )
        return _refusal(handler, f"{self.what}: missing or wrong auth token for {method}")


def _refusal(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    # The status is set rather than raised with context.abort(): grpc keeps that exception on
    # the call's state, and its traceback holds the context, a reference cycle that keeps the
    # server alive until a garbage collection.
    async def unary(request: Any, context: grpc.aio.ServicerContext) -> None:
        context.set_code(grpc.StatusCode.UNAUTHENTICATED)
        context.set_details(message)

    async def streaming(request: Any, context: grpc.aio.ServicerContext) -> Any:
        context.set_code(grpc.StatusCode.UNAUTHENTICATED)
        context.set_details(message)
        return
        yield  # makes this an async generator, as streaming handlers are

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(streaming)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(unary)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(streaming)
    return grpc.unary_unary_rpc_method_handler(unary)


def server_interceptors(security: Security, what: str) -> list[grpc.aio.ServerInterceptor]:
    """The interceptors of a gRPC server ``what`` (named in refusals): none without a token."""
    return [_TokenInterceptor(security, what)] if security.token else []


# -- the programs' flags ------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``--auth-token-file`` and ``--tls-cert/--tls-key/--tls-ca`` (the programs' shared flags)."""
    parser.add_argument(
        "--auth-token-file",
        default=None,
        help=f"file holding the job's shared token (default: ${TOKEN_ENV} or ${TOKEN_FILE_ENV})",
    )
    parser.add_argument("--tls-cert", default=None, help=f"PEM certificate chain (default: ${TLS_CERT_ENV})")
    parser.add_argument("--tls-key", default=None, help=f"PEM private key (default: ${TLS_KEY_ENV})")
    parser.add_argument(
        "--tls-ca",
        default=None,
        help=f"PEM CA that peers are verified against: mTLS (default: ${TLS_CA_ENV})",
    )


def from_arguments(args: argparse.Namespace) -> Security:
    """The :class:`Security` of a program's command line (completed from the environment)."""
    return Security.resolve(
        None, args.tls_cert, args.tls_key, args.tls_ca, auth_token_file=args.auth_token_file
    )


def to_environment(security: Security) -> dict[str, str]:
    """The variables that give a child process these credentials."""
    env = {TOKEN_ENV: security.token} if security.token else {}
    for name, value in (
        (TLS_CERT_ENV, security.tls_cert),
        (TLS_KEY_ENV, security.tls_key),
        (TLS_CA_ENV, security.tls_ca),
    ):
        if value:
            env[name] = os.path.abspath(value)
    return env


# -- the job token of a single-host job --------------------------------------------------------
def private_directory() -> str:
    """This user's owner-only runtime directory (``$TMPDIR/rpcdist-<uid>``, mode 0700).

    Refuses one that another user made, that is a symlink, or that others can enter: on a
    shared host nobody else can read, replace or plant files in it.
    """
    path = os.path.join(tempfile.gettempdir(), f"rpcdist-{os.getuid()}")
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise PermissionError(
            f"{path} is not a private directory of this user (owner uid {info.st_uid}, mode "
            f"{stat.S_IMODE(info.st_mode):o}); remove it or set TMPDIR elsewhere"
        )
    return path


def job_token_path(port: int) -> str:
    """Where the job token of the store on loopback port ``port`` is kept."""
    return os.path.join(private_directory(), f"store-{int(port)}.token")


def new_token() -> str:
    """A fresh random token (256 bits)."""
    return secrets.token_urlsafe(32)


_job_tokens: dict[int, str] = {}  # port -> the token this process's stores on it made


def job_token_for(port: int) -> str:
    """The token a store this process serves on ``port`` makes for its job: fresh the first
    time, the same again for the next store on that port (init_rpc after init_process_group,
    or again after shutdown, is one job: a member that read the previous store's token file
    just before it went keeps a token that still opens the next one and its links)."""
    token = _job_tokens.get(port)
    if token is None:
        token = _job_tokens[port] = new_token()
    return token


def publish_job_token(port: int, token: str) -> None:
    """Leave ``token``, readable by this user only, where the members of the job whose store
    is on loopback ``port`` look for it (replacing a stale one)."""
    path = job_token_path(port)
    fd, staging = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".token-")  # mode 0600
    try:
        os.write(fd, token.encode())
    finally:
        os.close(fd)
    os.replace(staging, path)  # readers never see half a token


def read_job_token(port: int) -> str | None:
    """The job token published for loopback ``port`` (None if there is none yet)."""
    try:
        with open(job_token_path(port), "rb") as f:
            text = f.read().decode("ascii", errors="replace").strip()
    except (FileNotFoundError, PermissionError):
        return None
    return text or None


def withdraw_job_token(port: int, token: str) -> None:
    """Remove the job token file of ``port`` if it still holds ``token`` (not a newer job's)."""
    try:
        if read_job_token(port) == token:
            os.unlink(job_token_path(port))
    except OSError:
        pass
