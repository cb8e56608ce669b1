"""Write a random-weight vision model folder in the hub layout, with its processor files, so a vision model
can be served here without a download: transformers' own model class, initialised at random (the text
model's weights scaled so its logits are peaked, as tests/tiny_models.py's), saved as it saves them.

    python -m kvfork.tools.vision_model --family smolvlm --out FOLDER [--size tiny|256m]

Families: smolvlm (Idefics3ForConditionalGeneration; its text model is llama), smolvlm2
(SmolVLMForConditionalGeneration, `model_type: smolvlm`: the same architecture under SmolVLM2's names); qwen2_5_vl
(Qwen2_5_VLForConditionalGeneration, M-RoPE) and gemma3 (Gemma3ForConditionalGeneration, SigLIP), tiny only,
written by tools/vision_family_models.py with this module's tokenizer. Sizes: `tiny` for tests
(tiles of 32 pixels, 4 tokens a tile), `256m` at SmolVLM-256M's shapes (the replay benchmark's). The
tokenizer is a small byte-level BPE trained here, with the family's image tokens.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from kvfork.tools import vision_family_models

# SmolVLM-256M's shapes (its config.json), and a tiny model of the same layout
SIZES = {
    "tiny": dict(
        text=dict(vision_family_models.TEXT, rms_norm_eps=1e-5),  # its heads: `write`'s head_dim
        vision=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                    image_size=32, patch_size=8),
        scale_factor=2, longest_edge=64, vocab=512),
    "256m": dict(
        text=dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                  num_key_value_heads=3, head_dim=64, max_position_embeddings=8192, rope_theta=100000.0,
                  rms_norm_eps=1e-5),
        vision=dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                    image_size=512, patch_size=16),
        scale_factor=4, longest_edge=2048, vocab=49280),
}
# a SmolVLM family -> transformers' (config, model, image processor, processor) class names, its vision model_type
SMOLVLM = {"smolvlm": (("Idefics3Config", "Idefics3ForConditionalGeneration", "Idefics3ImageProcessorPil",
                        "Idefics3Processor"), "idefics3_vision"),
           "smolvlm2": (("SmolVLMConfig", "SmolVLMForConditionalGeneration", "SmolVLMImageProcessorPil",
                         "SmolVLMProcessor"), "smolvlm_vision")}
FAMILIES = (*SMOLVLM, *vision_family_models.FAMILIES)
IMAGE_TOKENS = ["<fake_token_around_image>", "<image>", "<global-img>", "<end_of_utterance>",
                *(f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7))]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *IMAGE_TOKENS]
# SmolVLM's turn layout, its content read as text (kvfork writes each image part as a mark in the text)
TEMPLATE = ("<|im_start|>{% for message in messages %}{{ message['role'] | capitalize }}: {{ message['content'] }}"
            "<end_of_utterance>\n{% endfor %}{% if add_generation_prompt %}Assistant:{% endif %}")
_WORDS = ("the a of to in is was for on that with as by at from it this be are or have user assistant tool "
          "call result file screen button window click open close page image picture text shows what see read "
          "describe left right top bottom red green blue number first next").split()


def _tokenizer(vocab: int):
    """A byte-level BPE trained on a few words, with the special tokens first."""
    import random

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    rng = random.Random(0)
    lines = [" ".join(rng.choices(_WORDS, k=12)) + f" {rng.randrange(1000)}." for _ in range(400)]
    tok.train_from_iterator(lines, trainers.BpeTrainer(vocab_size=min(vocab, 1024), special_tokens=SPECIALS,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                       show_progress=False))
    return tok


def write(out: Path, size: str = "tiny", seed: int = 0, family: str = "smolvlm", head_dim: int = 16) -> Path:
    """A random `family` model in `out`: smolvlm and smolvlm2 at `size`; qwen2_5_vl and gemma3 tiny only
    (tools/vision_family_models.py), with this module's tokenizer. A tiny model's text heads are `head_dim` wide
    (`vision_family_models.text_heads`: 64 can be stored at any --kv-cache-dtype)."""
    if family not in SMOLVLM:
        from transformers import PreTrainedTokenizerFast

        if size != "tiny":
            raise ValueError(f"{family} is written tiny only")
        out.mkdir(parents=True, exist_ok=True)
        PreTrainedTokenizerFast(tokenizer_object=_tokenizer(SIZES["tiny"]["vocab"]), eos_token="<|im_end|>",
                                pad_token="<|endoftext|>").save_pretrained(str(out))
        return vision_family_models.write(family, out, out, seed, head_dim)
    import torch
    import transformers
    from transformers import PreTrainedTokenizerFast

    (config_class, model_class, images_class, processor_class), vision_type = SMOLVLM[family]
    shape = SIZES[size]
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=_tokenizer(shape["vocab"]), eos_token="<end_of_utterance>",
                                        pad_token="<|endoftext|>", chat_template=TEMPLATE,
                                        additional_special_tokens=IMAGE_TOKENS)
    tokenizer.save_pretrained(str(out))
    eos = tokenizer.convert_tokens_to_ids("<end_of_utterance>")
    heads = vision_family_models.text_heads(head_dim) if size == "tiny" else {}
    text = dict(model_type="llama", vocab_size=max(shape["vocab"], len(tokenizer)), eos_token_id=eos, pad_token_id=0,
                tie_word_embeddings=False, **shape["text"], **heads)
    config = getattr(transformers, config_class)(
        text_config=text, vision_config=dict(model_type=vision_type, **shape["vision"]),
        scale_factor=shape["scale_factor"], image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        eos_token_id=eos, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = getattr(transformers, model_class)(config).eval()
    vision_family_models.peaked(model, ("model.text_model.", "lm_head."))
    model.save_pretrained(str(out))
    vision = shape["vision"]
    getattr(transformers, images_class)(size={"longest_edge": shape["longest_edge"]},
                                        max_image_size={"longest_edge": vision["image_size"]}).save_pretrained(str(out))
    tokens = (vision["image_size"] // vision["patch_size"]) ** 2 // shape["scale_factor"] ** 2
    (out / "processor_config.json").write_text(json.dumps({"processor_class": processor_class,
                                                          "image_seq_len": tokens}, indent=2))
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--family", required=True, choices=FAMILIES, help="the vision family")
    parser.add_argument("--out", required=True, help="folder to write")
    parser.add_argument("--size", default="tiny", choices=list(SIZES), help="tiny (tests) or 256m (SmolVLM-256M's "
                        "shapes, for benchmarks)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(write(Path(args.out), args.size, args.seed, args.family))


if __name__ == "__main__":
    main()
