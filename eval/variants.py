"""Option sets that benchmarks and evaluations name after a method as "@name" (`bench/decode.py`,
`eval/report.py`)."""

from __future__ import annotations

OPTION_VARIANTS = {
    "bits": dict(scorer="bits"),
    "bound": dict(scorer="bound"),
    "half": dict(summary_channels=0.5),  # what the default picks with the bits scorer
    "full": dict(summary_channels=1.0),  # the bits summaries on every key channel
    "sdpa": dict(attention_kernel=False),  # decode attention through SDPA, as before the Triton kernel
    "headonly": dict(chain_drafts=False),  # eagle3: the head drafts every step (no chained drafts)
    "compiled": dict(compile_decode=True),  # the layers' own work torch.compile'd in decode steps
    "compiledsoon": dict(compile_decode=None, compile_after_steps=4),  # the default's switch, at the 4th step
    "topk": dict(top_k_kernel=True),  # the k best blocks by the package's select kernel (the default on Triton)
    "torchtopk": dict(top_k_kernel=False),  # ... by torch.topk, best first
    "compiledtopk": dict(compile_decode=True, top_k_kernel=True),
    "compiledfused": dict(compile_decode=True, fuse_projections=True),  # + q/k/v and gate/up as one product each
    "compiledtorchtopk": dict(compile_decode=True, top_k_kernel=False),
    # the gather kernel on so many programs (default: chosen by the package; docs/performance.md)
    "gatherall": dict(gather_programs=0),  # one program per block, the default
    "gather16": dict(gather_programs=16),
    "gather32": dict(gather_programs=32),
    "gather64": dict(gather_programs=64),
    "gather128": dict(gather_programs=128),
    # the host pool's representation (`host_dtype`; default: the model's dtype)
    "fp8": dict(host_dtype="fp8"),
    "int4": dict(host_dtype="int4"),
}


def variant_options(name: str) -> dict:
    """The options of an "@name" variant (`OPTION_VARIANTS`), or of several joined by "+" (e.g. "compiled+gather64";
    two that set one option differently are refused); "" gives none."""
    options = {}
    for part in filter(None, name.split("+")):
        chosen = OPTION_VARIANTS.get(part)
        if chosen is None:
            raise ValueError(f"unknown option variant @{part}: one of {', '.join('@' + v for v in OPTION_VARIANTS)} "
                             f"(several joined by '+')")
        clash = {k for k, v in chosen.items() if k in options and options[k] != v}
        if clash:
            raise ValueError(f"option variant @{name}: @{part} sets {', '.join(sorted(clash))} otherwise")
        options.update(chosen)
    return options
