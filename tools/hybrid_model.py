"""Write a random-weight hybrid model folder at the layer sizes of Qwen3.5-0.8B (tools/hybrid_bench.py's
SHAPE), for the benchmarks (tools/backend_bench.py, on either backend): Gated DeltaNet layers with
every 4th layer full attention. The weights are mlx-lm's own initialisation, in mlx-community
layout; the tokenizer is the default model's (benchmarks draw token ids below 30,000).

    python -m kvfork.tools.hybrid_model --out FOLDER [--dtype float32]
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from kvfork.tools.hybrid_bench import SHAPE  # the shape, stated once

CONFIG = dict(model_type="qwen3_5", architectures=["Qwen3_5ForConditionalGeneration"], text_config=SHAPE,
              tie_word_embeddings=True)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def write(out: Path, dtype: str, tokenizer_from: Path) -> Path:
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes

    out.mkdir(parents=True, exist_ok=True)
    model_cls, args_cls = _get_classes(CONFIG)
    model = model_cls(args_cls.from_dict(CONFIG))
    model.set_dtype(getattr(mx, dtype))
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    eos = json.loads((tokenizer_from / "config.json").read_text()).get("eos_token_id")
    (out / "config.json").write_text(json.dumps(dict(CONFIG, eos_token_id=eos, torch_dtype=dtype), indent=2))
    for name in TOKENIZER_FILES:
        shutil.copy(tokenizer_from / name, out / name)
    return out


def main(argv: list[str] | None = None) -> None:
    from kvfork.backends.default_model import default_model_dir

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="folder to write")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--tokenizer", default=None, help="a model folder to take the tokenizer from "
                        "(default: the default model's, `fetch-model`)")
    args = parser.parse_args(argv)
    print(write(Path(args.out), args.dtype, Path(args.tokenizer) if args.tokenizer else default_model_dir()))


if __name__ == "__main__":
    main()
