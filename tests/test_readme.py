import re
from pathlib import Path

import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig

from tiny_tokenizer import tiny_tokenizer

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_example_runs_against_a_local_checkpoint(tmp_path, capsys):
    (example,) = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    checkpoint = re.search(r'from_pretrained\("([^"]+)"', example).group(1)
    tokenizer = tiny_tokenizer()
    config = Gemma3TextConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=16,
        max_position_embeddings=8192, initializer_range=0.03, tie_word_embeddings=False,
        eos_token_id=None, bos_token_id=None, pad_token_id=None,
    )  # fmt: skip
    torch.manual_seed(0)
    Gemma3ForCausalLM(config).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    exec(compile(example.replace(checkpoint, str(tmp_path)), "README.md", "exec"), {})
    assert "prefix_cache_hits" in capsys.readouterr().out
