"""The torch CPU backend's linear layers: MKL on the checkpoint's [out, in] weights (plain
`F.linear`) against oneDNN on weights reordered once (backends/torch/packed_linear.py).

    python -m kvfork.tools.linear_bench [--model FOLDER] [--rows 1,4,8,512] [--repeats 7]

One pass = every linear layer of the model once, at its own shape (random weights: speed depends on
shapes, not values), for each row count; best of `--repeats` for each kind, MKL's first. Also a plain
read of the same bytes (the memory floor) and the resident memory the oneDNN kernels of every
padded row count take once compiled.
"""

from __future__ import annotations

import argparse
import json
import time

from kvfork.backends.default_model import default_model_dir
from kvfork.tools.memory import rss_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(default_model_dir()))
    parser.add_argument("--rows", default="1,4,8,512")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()

    import torch
    import torch.nn.functional as F

    from kvfork.backends.torch import packed_linear
    from kvfork.backends.torch.config import ArchConfig, read_config

    cfg = read_config(args.model)
    assert isinstance(cfg, ArchConfig), "a transformer's shapes (llama, qwen, gemma)"
    d, q, kv, f = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    shapes = [(q, d), (kv, d), (kv, d), (d, q), (f, d), (f, d), (d, f)] * len(cfg.sliding) + [(cfg.vocab_size, d)]
    torch.manual_seed(0)
    weights = [torch.randn(*shape) for shape in shapes]
    packed = [packed_linear.PackedLinear(w) for w in weights]
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    flat = torch.randn(nbytes // 4)

    def best(fn) -> float:
        times = []
        for _ in range(args.repeats):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return min(times)

    report: dict = {"weight_mb": round(nbytes / 1e6), "read_gb_s": round(nbytes / best(flat.sum) / 1e9, 1),
                    "threads": torch.get_num_threads(), "rows": {}}
    with torch.inference_mode():
        rss = rss_bytes()
        model = torch.nn.Sequential(*packed[:-1])
        model.lm_head = packed[-1]  # warmed only at decode row counts, as the backend does
        packed_linear.warm(model)
        report["kernels_mib"] = round((rss_bytes() - rss) / 2**20, 1)
        for n in (int(r) for r in args.rows.split(",")):
            xs = {k: torch.randn(n, k) for k in {w.shape[1] for w in weights}}
            mkl = best(lambda: [F.linear(xs[w.shape[1]], w) for w in weights])
            dnn = best(lambda: [p(xs[p.in_features]) for p in packed])
            report["rows"][n] = {"mkl_ms": round(mkl * 1e3, 1), "onednn_ms": round(dnn * 1e3, 1),
                                 "mkl_gb_s": round(nbytes / mkl / 1e9, 1), "onednn_gb_s": round(nbytes / dnn / 1e9, 1),
                                 "mkl_over_onednn": round(mkl / dnn, 2)}
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
