"""Exception types shared across cpu_opt."""


class CpuOptError(RuntimeError):
    """Base class of cpu_opt's own errors."""


class DnnlError(CpuOptError):
    """A oneDNN call returned a status other than dnnl_success; ``status`` holds its name."""

    def __init__(self, status: str, call: str, detail: str = ""):
        self.status = status
        self.call = call
        msg = f"{call} failed with {status}"
        super().__init__(msg + (f": {detail}" if detail else ""))


class DnnlUnavailableError(CpuOptError):
    """libdnnl (the oneDNN binding's library) could not be found or loaded."""


class NativeKernelError(CpuOptError):
    """A native kernel rejected its arguments (the check ran before any memory was touched)."""


class UnsupportedError(CpuOptError):
    """Something cpu_opt cannot lower or run, with the reason."""
