"""Reading and writing EAGLE-3 draft heads in the published formats:

- EAGLE / SpecForge: `config.json` (a LlamaConfig with `draft_vocab_size`, optional `target_hidden_size`,
  `eagle_config.eagle_aux_hidden_state_layer_ids`) and `model.safetensors` or `pytorch_model.bin` with keys `fc.*`,
  `midlayer.*`, `norm.*`, `lm_head.*`, `d2t`, `t2d`.
- vLLM speculators: `config.json` with `speculators_model_type: "eagle3"`, `transformer_layer_config` (Llama),
  `draft_vocab_size`, `target_hidden_size`, `norm_before_residual`, `eagle_aux_hidden_state_layer_ids`; weights
  with `layers.0.*` in place of `midlayer.*` (and possibly `embed_tokens.*`, unused: the target's table is used).

A head of more than one decoder layer (ours, `Eagle3Config.num_hidden_layers`) keeps the format, with
`post_layers.{i}.*` after `midlayer.*` (speculators: `layers.{i + 1}.*`).

From a local directory, or a hub id when online.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .eagle3 import Eagle3Config, Eagle3Head

FORMATS = ("eagle", "speculators")


def save_eagle3(head: Eagle3Head, directory, format: str = "eagle") -> Path:
    """Write `head` as a checkpoint of `format` ("eagle" or "speculators") into `directory`."""
    from safetensors.torch import save_file

    if format not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {format!r}")
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    c = head.config
    llama = dict(
        architectures=["LlamaForCausalLMEagle3"], model_type="llama", hidden_size=c.hidden_size,
        num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim,
        intermediate_size=c.intermediate_size, vocab_size=c.vocab_size, rms_norm_eps=c.rms_norm_eps,
        rope_theta=c.rope_theta, max_position_embeddings=c.max_position_embeddings,
        num_hidden_layers=c.num_hidden_layers,
    )
    state = {k: v.detach().contiguous().cpu() for k, v in head.state_dict().items()}
    llama["oasis_attention_window"] = c.attention_window  # how this head was trained to attend (ours)
    if format == "eagle":
        config = dict(llama, draft_vocab_size=c.draft_vocab_size, target_hidden_size=c.target_hidden_size,
                      eagle_config=dict(eagle_aux_hidden_state_layer_ids=c.aux_hidden_state_ids),
                      norm_before_residual=c.norm_before_residual)
    else:
        config = dict(speculators_model_type="eagle3", architectures=["Eagle3Speculator"],
                      transformer_layer_config=llama, draft_vocab_size=c.draft_vocab_size,
                      target_hidden_size=c.target_hidden_size, norm_before_residual=c.norm_before_residual,
                      eagle_aux_hidden_state_layer_ids=c.aux_hidden_state_ids)
        state = {_speculators_name(k): v for k, v in state.items()}
    (out / "config.json").write_text(json.dumps(config, indent=1))
    save_file(state, str(out / "model.safetensors"))
    return out


def load_eagle3(source, target_model=None, device=None, dtype=None) -> Eagle3Head:
    """A head from a local directory or a hub id, in either format. With `target_model`, check that it fits
    (hidden size, vocabulary, layers) and fill in what the checkpoint leaves out (aux layers)."""
    directory = _resolve(source)
    config = json.loads((directory / "config.json").read_text())
    state = _read_weights(directory)
    if config.get("speculators_model_type") is not None:
        if config["speculators_model_type"] != "eagle3":
            raise ValueError(f"{source}: speculators_model_type {config['speculators_model_type']!r} is not eagle3")
        llama = config["transformer_layer_config"]
        aux = config.get("eagle_aux_hidden_state_layer_ids")
        state = {_our_name(k): v for k, v in state.items() if not k.startswith("embed_")}
    else:
        if not any(k.startswith("midlayer.") for k in state):
            raise ValueError(f"{source}: neither an EAGLE/SpecForge (midlayer.*) nor a speculators (eagle3) checkpoint")
        llama = config
        aux = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        state = {k: v for k, v in state.items() if not k.startswith("embed_")}
    draft_vocab = config.get("draft_vocab_size") or state["lm_head.weight"].shape[0]
    if aux is None:
        if target_model is None:
            raise ValueError(f"{source} does not say which target layers it reads; pass target_model")
        L = target_model.config.get_text_config(decoder=True).num_hidden_layers
        aux = [2, L // 2, L - 3]
    head_config = Eagle3Config(
        hidden_size=llama["hidden_size"], num_attention_heads=llama["num_attention_heads"],
        num_key_value_heads=llama.get("num_key_value_heads", llama["num_attention_heads"]),
        intermediate_size=llama["intermediate_size"], vocab_size=llama["vocab_size"], draft_vocab_size=draft_vocab,
        target_hidden_size=config.get("target_hidden_size"), head_dim=llama.get("head_dim"),
        rms_norm_eps=llama.get("rms_norm_eps", 1e-6), rope_theta=llama.get("rope_theta", 10000.0),
        max_position_embeddings=llama.get("max_position_embeddings", 8192), aux_hidden_state_ids=list(aux),
        norm_before_residual=bool(config.get("norm_before_residual", False)),
        attention_window=llama.get("oasis_attention_window"),  # published heads attend to all rows
        num_hidden_layers=_decoder_layers(state),
    )
    if target_model is not None:
        check_fits(head_config, target_model, source)
    head = Eagle3Head(head_config)
    if "t2d" not in state and "d2t" in state:  # some checkpoints carry only d2t
        t2d = torch.zeros(head_config.vocab_size, dtype=torch.bool)
        t2d[torch.arange(draft_vocab) + state["d2t"]] = True
        state["t2d"] = t2d
    missing, unexpected = head.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"{source}: weights do not match an EAGLE-3 head: missing {missing}, unexpected {unexpected}")
    return head.to(device=device, dtype=dtype) if (device or dtype) else head


def _speculators_name(key: str) -> str:
    if key.startswith("midlayer."):
        return "layers.0." + key[len("midlayer."):]
    if key.startswith("post_layers."):
        index, rest = key[len("post_layers."):].split(".", 1)
        return f"layers.{int(index) + 1}.{rest}"
    return key


def _our_name(key: str) -> str:
    if key.startswith("layers."):
        index, rest = key[len("layers."):].split(".", 1)
        return f"midlayer.{rest}" if index == "0" else f"post_layers.{int(index) - 1}.{rest}"
    return key


def _decoder_layers(state: dict) -> int:
    """Decoder layers in a checkpoint's weights (ours named): `midlayer` and each `post_layers.{i}`. The weights,
    not `num_hidden_layers` of the config: published EAGLE-3 configs say 1 or copy the target's count."""
    return 1 + len({k.split(".")[1] for k in state if k.startswith("post_layers.")})


def check_fits(config: Eagle3Config, target_model, source="the head") -> None:
    """Raise a clear error when a head was made for another target."""
    c = target_model.config.get_text_config(decoder=True)
    problems = []
    if config.target_hidden_size != c.hidden_size:
        problems.append(f"it reads hidden states of size {config.target_hidden_size}, the target's are {c.hidden_size}")
    if config.hidden_size != c.hidden_size:
        problems.append(f"its embeddings are of size {config.hidden_size}, the target's are {c.hidden_size}")
    if config.vocab_size != c.vocab_size:
        problems.append(f"it maps to a vocabulary of {config.vocab_size}, the target has {c.vocab_size}")
    if max(config.aux_hidden_state_ids) > c.num_hidden_layers:
        problems.append(f"it reads layers {config.aux_hidden_state_ids}, the target has {c.num_hidden_layers}")
    if problems:
        raise ValueError(f"{source} does not fit {type(target_model).__name__}: " + "; ".join(problems) + ".")


def _resolve(source) -> Path:
    path = Path(source)
    if path.is_dir():
        return path
    if path.exists() or str(source).startswith((".", "/")):
        raise FileNotFoundError(f"{source} is not a directory with config.json and weights")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(str(source), allow_patterns=["*.json", "*.safetensors", "*.bin"]))
    except Exception as e:  # offline, unknown id, ...
        raise FileNotFoundError(f"could not get draft head {source!r} from the hub ({type(e).__name__}: {e}); "
                                f"pass a local directory instead") from e


def _read_weights(directory: Path) -> dict:
    if (directory / "model.safetensors").exists():
        from safetensors.torch import load_file

        return load_file(str(directory / "model.safetensors"))
    if (directory / "pytorch_model.bin").exists():
        return torch.load(directory / "pytorch_model.bin", map_location="cpu", weights_only=True)
    raise FileNotFoundError(f"{directory} has no model.safetensors or pytorch_model.bin")
