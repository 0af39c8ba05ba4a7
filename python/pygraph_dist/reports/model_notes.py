"""What a model computes differently while a CUDA graph is captured.

Some libraries branch on ``torch.cuda.is_current_stream_capturing()``: they take
another code path while a graph is being captured than when the same forward
runs eagerly, and a graph replays the path it captured. Where the two paths run
other kernels, a graphed step is close to an eager one but not bitwise equal.
This module names such models, so that :func:`pygraph_dist.report` says so
instead of leaving a silent difference (docs/limits.md, "Not bitwise").

Known case, transformers 5.x (checked on 5.17.0):
``masking_utils._ignore_causal_mask_sdpa`` returns False under
``utils.import_utils.is_tracing()``, which is true during CUDA capture. Eagerly,
an all-ones ``attention_mask`` lets SDPA run with ``is_causal=True`` and no mask;
captured, the mask is built. For grouped-query attention this also changes
``integrations/sdpa_attention.use_gqa_in_sdpa`` (``enable_gqa`` only without a
mask), so the captured step repeats the keys and values and runs a masked SDPA.
Measured on one H200 (torch 2.11.0+cu130): Llama and Mistral (4 x 256, 2 key/value
heads) differ from ``graphs=False`` from the captured iteration on (5e-5 max
|diff| in the weights after 16 steps); the same Mistral with
``attn_implementation="eager"`` and GPT-2 and BERT (no grouped keys) are bitwise.

Second case, the same branch with eager attention in an encoder (MPNet; checked
on 5.17.0): ``eager_mask`` skips an all-ones bidirectional mask eagerly and
builds it under capture, a float mask added to bf16 attention scores (3e-9 max
|diff| in MPNet's weights after 16 steps, one H200).

Reads the model's ``config`` only; imports nothing the model has not imported.
"""

from __future__ import annotations

import sys

GQA_SDPA = (  # the outcome and the fix first: the default report shows the first 160 characters
    "{model} (transformers {version}): graphed steps are not bitwise equal to graphs=False (close); "
    "for bitwise ones load it with attn_implementation=\"eager\" (slower attention). Why: "
    "grouped-query attention ({heads} query heads, {kv} key/value heads) through SDPA, and transformers "
    "builds the causal mask while a CUDA graph is captured but skips it eagerly (masking_utils: "
    "is_tracing() is true during capture), so graphed steps run a masked SDPA on repeated keys and eager "
    "steps SDPA(is_causal, enable_gqa)."
)


EAGER_BIDIRECTIONAL = (
    "{model} (transformers {version}): graphed steps are not bitwise equal to graphs=False (close). Why: "
    "with eager attention, transformers skips an all-ones bidirectional attention mask eagerly but builds "
    "it while a CUDA graph is captured (masking_utils: is_tracing() is true during capture), a float mask "
    "added to the attention scores, so graphed steps (and the warm-ups that rehearse the capture) add it "
    "and eager steps do not."
)


def _bidirectional_eager(sub, config) -> bool:
    """An encoder layer whose library module builds bidirectional masks (MPNet, BERT-style
    models) running transformers' eager attention."""
    if getattr(config, "_attn_implementation", None) != "eager" or getattr(config, "is_decoder", False):
        return False
    return hasattr(sys.modules.get(type(sub).__module__), "create_bidirectional_mask")


def _transformers_branches_on_capture() -> str:
    """transformers' version when its ``is_tracing`` counts CUDA capture, else ''."""
    utils = sys.modules.get("transformers.utils.import_utils")
    if utils is None or not hasattr(utils, "is_cuda_stream_capturing"):
        return ""
    return getattr(sys.modules.get("transformers"), "__version__", "?")


def capture_divergences(module) -> list[str]:
    """One sentence per known way ``module`` computes differently when captured."""
    version = _transformers_branches_on_capture()
    if not version:
        return []
    for sub in module.modules():
        config = getattr(sub, "config", None)
        impl = getattr(config, "_attn_implementation", None)
        heads = getattr(config, "num_attention_heads", None)
        kv = getattr(config, "num_key_value_heads", None)
        if (impl == "sdpa" and isinstance(heads, int) and isinstance(kv, int) and 0 < kv < heads):
            return [GQA_SDPA.format(model=type(sub).__name__, version=version, heads=heads, kv=kv)]
        if _bidirectional_eager(sub, config):
            return [EAGER_BIDIRECTIONAL.format(model=type(sub).__name__, version=version)]
    return []
