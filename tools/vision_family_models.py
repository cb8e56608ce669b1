"""Tiny random vision-language models of the families whose text model is kvfork's own torch model
(backends/torch/vision_towers.py): Qwen2.5-VL (M-RoPE) and Gemma 3 (SigLIP, images attended both ways).

Each folder is in the hub layout, as transformers writes it: config.json, model.safetensors (transformers'
own random initialisation of Qwen2_5_VLForConditionalGeneration / Gemma3ForConditionalGeneration, the text
model's weights drawn wider so its logits are peaked: near-ties would flip greedy tokens between two exact paths),
preprocessor_config.json (the family's image processor, at small sizes so an image takes a few tokens),
and a tokenizer: another model's (`tokenizer_from`) with the family's image tokens added and a ChatML
template that puts the family's marker where a message has an image part.

    python -m kvfork.tools.vision_family_models --family qwen2_5_vl --out FOLDER [--tokenizer FOLDER]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, rms_norm_eps=1e-6, max_position_embeddings=4096)
IMAGE_TOKENS = {  # the family's special tokens: (opening, the image's token, closing)
    "qwen2_5_vl": ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>"),
    "gemma3": ("<start_of_image>", "<image_soft_token>", "<end_of_image>"),
}
MARKERS = {"qwen2_5_vl": "<|vision_start|><|image_pad|><|vision_end|>", "gemma3": "<start_of_image>"}


def chat_template(marker: str) -> str:
    """ChatML, a message's content a string or parts: text as it is, an image part as `marker`."""
    return (
        "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
        "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
        "{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}"
        "{% else %}{{ '" + marker + "' }}{% endif %}{% endfor %}{% endif %}"
        "{{ '<|im_end|>\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    )


def _tokenizer(family: str, out: Path, source: Path) -> dict[str, int]:
    """The source's tokenizer with the family's image tokens, written to `out`; returns the ids of the
    image tokens and `vocab_size`, `eos`."""
    from tokenizers import AddedToken, Tokenizer

    tok = Tokenizer.from_file(str(source / "tokenizer.json"))
    tokens = IMAGE_TOKENS[family]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in tokens])
    tok.save(str(out / "tokenizer.json"))
    config = json.loads((source / "tokenizer_config.json").read_text())
    config.pop("added_tokens_decoder", None)
    config["chat_template"] = chat_template(MARKERS[family])
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    eos = config.get("eos_token")
    eos = eos if isinstance(eos, str) else eos["content"]
    return dict({t: tok.token_to_id(t) for t in tokens}, vocab_size=tok.get_vocab_size(), eos=tok.token_to_id(eos))


def text_heads(head_dim: int) -> dict[str, int]:
    """The text model's attention in heads of `head_dim`: the hidden width (64) in query heads, half as many key
    heads (one at least). Heads of 16 are the tests' usual; 64 can be stored at any --kv-cache-dtype."""
    heads = TEXT["hidden_size"] // head_dim
    return dict(head_dim=head_dim, num_attention_heads=heads, num_key_value_heads=max(1, heads // 2))


def _qwen2_5_vl(ids: dict[str, int], head_dim: int):
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    sections = [head_dim // 8, head_dim * 3 // 16, head_dim * 3 // 16]  # temporal, height, width: half the head
    text = dict(TEXT, **text_heads(head_dim), vocab_size=ids["vocab_size"], eos_token_id=ids["eos"],
                tie_word_embeddings=True,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": sections})
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=TEXT["hidden_size"],
                  patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=56, fullatt_block_indexes=[1])
    config = Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
                              vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
                              tie_word_embeddings=True)
    # at most 8 x 8 patches: an image takes up to 16 tokens
    processor = Qwen2VLImageProcessorPil(min_pixels=28 * 28, max_pixels=28 * 28 * 16, patch_size=14, merge_size=2,
                                         temporal_patch_size=2)
    return Qwen2_5_VLForConditionalGeneration(config), processor


def _gemma3(ids: dict[str, int], head_dim: int):
    import torch
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    text = dict(TEXT, **text_heads(head_dim), num_hidden_layers=3, vocab_size=ids["vocab_size"],
                eos_token_id=ids["eos"], sliding_window=8,
                layer_types=["sliding_attention", "sliding_attention", "full_attention"], query_pre_attn_scalar=head_dim,
                hidden_activation="gelu_pytorch_tanh", final_logit_softcapping=None, attn_logit_softcapping=None)
    # 112 pixels in 14-pixel patches: 8 x 8, pooled to 4 x 4 = 16 tokens, more than the sliding window
    vision = dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=2, image_size=112, patch_size=14)
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=16,
                          boi_token_index=ids["<start_of_image>"], eoi_token_index=ids["<end_of_image>"],
                          image_token_index=ids["<image_soft_token>"])
    processor = Gemma3ImageProcessorPil(size={"height": 112, "width": 112})
    model = Gemma3ForConditionalGeneration(config)
    projection = model.model.multi_modal_projector.mm_input_projection_weight  # transformers starts it at zero
    with torch.no_grad():
        projection.normal_(0.0, projection.shape[0] ** -0.5)  # so an image's pixels reach the text model
    return model, processor


def peaked(model, prefixes: tuple[str, ...]) -> None:
    """Redraw the matrices of the parameters under `prefixes` (the text model's) so its logits are peaked:
    embeddings at unit scale, every other matrix at 1 / sqrt(its input width)."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith(prefixes) and p.dim() >= 2:
                p.normal_(0.0, 1.0 if "embed_tokens" in name else p.shape[-1] ** -0.5)


WRITERS = {"qwen2_5_vl": _qwen2_5_vl, "gemma3": _gemma3}
FAMILIES = tuple(WRITERS)


def write(family: str, out: Path, tokenizer_from: Path, seed: int = 0, head_dim: int = 16) -> Path:
    """A tiny random `family` model in `out` (created), its tokenizer from the folder `tokenizer_from`, its text
    model's heads `head_dim` wide (`text_heads`)."""
    import torch

    out.mkdir(parents=True, exist_ok=True)
    ids = _tokenizer(family, out, tokenizer_from)
    torch.manual_seed(seed)
    model, processor = WRITERS[family](ids, head_dim)
    peaked(model, ("model.language_model.", "lm_head."))
    model.save_pretrained(out)
    processor.save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> None:
    from kvfork.backends.default_model import default_model_dir

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--family", required=True, choices=sorted(WRITERS))
    parser.add_argument("--out", required=True, help="folder to write")
    parser.add_argument("--tokenizer", default=None, help="a model folder to take the tokenizer from "
                        "(default: the default model's, `fetch-model`)")
    args = parser.parse_args(argv)
    print(write(args.family, Path(args.out), Path(args.tokenizer) if args.tokenizer else default_model_dir()))


if __name__ == "__main__":
    main()
