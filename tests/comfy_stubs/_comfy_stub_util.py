"""Shared helper for the import-only torchvision/torchaudio test stubs."""

__all__ = ["StubUnavailableError", "unavailable"]


class StubUnavailableError(NotImplementedError):
    """Raised when stubbed torchvision/torchaudio functionality is used."""


def unavailable(qualname):
    """Return a placeholder class for `qualname`.

    Importing, referencing and subclassing it works; instantiating (i.e.
    calling it like the real function or class) raises StubUnavailableError.
    """

    def _raise(*args, **kwargs):
        raise StubUnavailableError(
            f"{qualname} is an import-only test stub: torchvision/torchaudio are "
            "not installed in the Comfy Metal test environment"
        )

    module, _, name = qualname.rpartition(".")
    return type(name, (), {"__new__": _raise, "__module__": module, "__qualname__": name})
