"""Exceptions raised by hsstore. Every message names the store, shard, file or sample at fault."""


from .redaction import recordable_url, scrub


class StoreError(Exception):
    """Base class: a store cannot be opened, read or written as asked. The message is scrubbed of secrets
    (a botocore error quotes the endpoint URL, which may carry a password)."""

    def __init__(self, *args) -> None:
        super().__init__(*(scrub(a) if isinstance(a, str) else a for a in args))


class ManifestError(StoreError):
    """The manifest is missing, malformed, of a newer format, or incompatible with what is written."""


class SampleError(StoreError, ValueError):
    """A sample handed to the writer has the wrong shape, dtype, layers or values."""


class CorruptionError(StoreError):
    """Stored bytes do not match their commit record (checksum, size or shape)."""


class FetchError(StoreError):
    """Objects could not be read after the client's retries (network, throttling, service errors): a fault
    of the path to the store, not of the stored bytes, so it is never skipped as corruption."""


def salvage_hint(url: str) -> str:
    """What to do about a store whose stored bytes fail their checks, for the one line that stops a reader: the
    damage costs only the samples it touched, and these two commands say which and keep the rest."""
    u = recordable_url(url)
    return (f"`hsstore verify {u}` names every damaged sample; `hsstore subset {u} NEW --skip-corrupt` copies every "
            "sample whose bytes verify into NEW")
