"""Names defined once: the routed experts' projections, how a packed model directory names each expert linear,
and where its weights are (model.safetensors or the shards a model.safetensors.index.json lists)."""
from __future__ import annotations

import json
import re
from fnmatch import fnmatch
from pathlib import Path

from moesq_core.paths import inside

PROJECTIONS = ("gate", "up", "down")  # an expert's linears, in this order everywhere
PROJ_NAMES = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}  # their names in checkpoints
# <prefix>.mlp.experts.<e>.<gate_proj|up_proj|down_proj>.<suffix>
EXPERT_RE = re.compile(
    r"^(?P<prefix>.+)\.mlp\.experts\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.(?P<suffix>\w+)$"
)
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# What a model directory holds besides config.json and the weights, and loaders read (tokenizer, generation
# config, templates; remote-code *.py): what `moesq pack` carries over from the source model.
CARRIED_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                 "vocab.json", "merges.txt", "generation_config.json", "chat_template.jinja", "chat_template.json",
                 "preprocessor_config.json", "tiktoken.model", "added_tokens.json")
# transformers' tokenizers read every *.jinja in this folder as a named chat template
CHAT_TEMPLATE_DIR = "additional_chat_templates"
CARRIED_PATTERNS = ("*.py", "*.jinja", f"{CHAT_TEMPLATE_DIR}/*.jinja")  # relative to the model directory


def _matches(relpath: str, pattern: str) -> bool:
    """Whether a relative path matches a pattern of CARRIED_PATTERNS' kind (the folder exactly, the name by
    fnmatch): "*.jinja" is a top-level template, not one in a folder."""
    folder, _, name = relpath.rpartition("/")
    want_folder, _, want_name = pattern.rpartition("/")
    return folder == want_folder and fnmatch(name, want_name)


def loaders_read(relpath: str) -> bool:
    """True for a file of a model directory that loaders read: config.json, the weights and index, CARRIED_*."""
    return (relpath in ("config.json", INDEX_FILE, *CARRIED_FILES)
            or any(_matches(relpath, pat) for pat in ("*.safetensors", *CARRIED_PATTERNS)))


def experts_prefix(layer: int) -> str:
    """Checkpoint name prefix of a layer's routed experts."""
    return f"model.layers.{layer}.mlp.experts"


def expert_linear(prefix: str, expert: int, proj: str) -> str:
    """<prefix>.<expert>.<gate_proj|up_proj|down_proj> for proj in PROJECTIONS."""
    return f"{prefix}.{expert}.{PROJ_NAMES[proj]}"


def parse_expert_tensor(name: str) -> tuple[str, int, str, str] | None:
    """(experts prefix, expert, projection in PROJECTIONS, suffix) of an expert linear's tensor name, else None."""
    m = EXPERT_RE.match(name)
    if m is None:
        return None
    proj = next(p for p, n in PROJ_NAMES.items() if n == m["proj"])
    return f"{m['prefix']}.mlp.experts", int(m["expert"]), proj, m["suffix"]


def read_index(root: str | Path) -> dict[str, str] | None:
    """The index's weight map {tensor: file}, None without an index; ValueError("unreadable: ...") if unreadable,
    UnsafePathError (a ValueError) naming the entry if a file it lists lies outside root."""
    index = Path(root) / INDEX_FILE
    if not index.exists():
        return None
    try:
        wm = json.loads(index.read_text())["weight_map"]
        if not isinstance(wm, dict):
            raise ValueError("weight_map is not an object")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"unreadable: {e}") from None
    checked: set[str] = set()
    for name, f in wm.items():
        if not (isinstance(f, str) and f in checked):
            inside(root, f, f"weight_map[{name!r}]")
            checked.add(f)
    return wm


def weight_files(root: str | Path) -> list[str]:
    """The weight files of a model directory (relative names): the index's shards or model.safetensors;
    [] when there is neither."""
    wm = read_index(root)
    if wm is not None:
        return sorted(set(wm.values()))
    return [SINGLE_FILE] if (Path(root) / SINGLE_FILE).exists() else []
