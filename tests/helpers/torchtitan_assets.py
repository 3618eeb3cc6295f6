"""What torchtitan's llama3 debug model trains on in the tests and benchmarks: a BPE
tokenizer trained on generated text, and that text as a local JSON dataset (no
download; the same files for the same ``root``)."""

import json
from pathlib import Path

WORDS = "the a of to and in is it that was for on are with as his they be at one have this from".split()


def make_assets(root: Path) -> Path:
    """Write ``root``/tokenizer and ``root``/data (torchtitan's ``--model.hf_assets_path``
    and ``--training.dataset_path``); returns ``root``."""
    import tokenizers
    import torch

    generator = torch.Generator().manual_seed(0)
    lines = [" ".join(WORDS[i] for i in torch.randint(len(WORDS), (60,), generator=generator).tolist())
             for _ in range(400)]
    (root / "data").mkdir(parents=True, exist_ok=True)
    (root / "data" / "train.json").write_text("\n".join(json.dumps({"text": line}) for line in lines))
    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    special = ["<unk>", "<|begin_of_text|>", "<|end_of_text|>"]
    tokenizer.train_from_iterator(lines, tokenizers.trainers.BpeTrainer(vocab_size=256, special_tokens=special))
    (root / "tokenizer").mkdir(exist_ok=True)
    tokenizer.save(str(root / "tokenizer" / "tokenizer.json"))
    (root / "tokenizer" / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>", "add_bos_token": True}))
    return root
