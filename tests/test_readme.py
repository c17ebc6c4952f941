import re
from pathlib import Path

from hybridkv.tiny import tiny_model

from tiny_tokenizer import tiny_tokenizer

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_example_runs_against_a_local_checkpoint(tmp_path, capsys):
    examples = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    # The quick start: the first example that patches a model (the tensor-parallel one needs torchrun:
    # tests/test_tensor_parallel.py runs its steps).
    example = next(block for block in examples if "hybridkv.patch(" in block)
    assert "tp_plan" not in example
    checkpoint = re.search(r'from_pretrained\("([^"]+)"', example).group(1)
    tokenizer = tiny_tokenizer()
    tiny_model("gemma3", vocab_size=len(tokenizer), max_position_embeddings=8192).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    exec(compile(example.replace(checkpoint, str(tmp_path)), "README.md", "exec"), {})
    assert "prefix_cache_hits" in capsys.readouterr().out
