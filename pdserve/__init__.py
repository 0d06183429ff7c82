"""pdserve: a prefill/decode-disaggregated LLM server."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pdserve.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams"]
__version__ = "0.1.0"

if TYPE_CHECKING:
    from pdserve.llm import LLM


def __getattr__(name: str) -> Any:
    # The offline engine pulls in torch; keep `import pdserve` light for the CLI.
    if name == "LLM":
        from pdserve.llm import LLM

        return LLM
    raise AttributeError(name)
