"""Loading the native extension ``pygraph_dist._C``, with errors that say what to do."""

from __future__ import annotations

import torch

try:
    from .. import _C  # type: ignore[attr-defined]
except ImportError as exc:  # pragma: no cover - exercised only on broken installs
    raise ImportError(
        "pygraph_dist's native extension (pygraph_dist._C) could not be imported: "
        f"{exc}. Build and install it into this Python with "
        "`pip install --no-build-isolation .` from the repository root "
        "(torch must already be installed; see README.md)."
    ) from exc


def _major_minor(version: str) -> tuple[int, int]:
    parts = version.split("+")[0].split(".")
    return int(parts[0]), int(parts[1])


# c10d is not part of libtorch's stable ABI: an extension built against one
# torch minor can crash on another. Fail at import with the fix, not later.
if _major_minor(_C.__torch_version__) != _major_minor(torch.__version__):
    raise ImportError(
        f"pygraph_dist._C was built against torch {_C.__torch_version__} but torch "
        f"{torch.__version__} is installed. Rebuild it against the installed torch: "
        "`pip install --no-build-isolation --force-reinstall --no-deps .`"
    )

C = _C
NOT_CAPTURABLE_TAG: str = _C.not_capturable_tag


def graphs_available() -> tuple[bool, str]:
    """Whether CUDA graphs can be used in this process, and why not if they cannot."""
    if not _C.cuda_enabled:
        if torch.version.cuda is None:
            return False, (
                f"torch {torch.__version__} is a CPU-only build, so CUDA graphs are "
                "unavailable; training runs eagerly"
            )
        return False, (
            "pygraph_dist._C was built without its CUDA code paths; rebuild with a "
            "CUDA build of torch to capture graphs"
        )
    if not torch.cuda.is_available():
        return False, "no CUDA device is visible, so CUDA graphs are unavailable"
    return True, ""
