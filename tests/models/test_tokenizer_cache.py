"""A tokenizer loads once per process and content; copies share the backend, and sharing stays thread-safe."""

import shutil
from concurrent.futures import ThreadPoolExecutor, wait

from serve_app.models import ensure_qwen2_tokenizer
from serve_app.models.tokenizer_cache import load_tokenizer
from serve_app.policies.qwen_text import QwenImageTextProcessor
from serve_app.policies.single_tokenizer import WanTextProcessor


def test_a_tokenizer_loads_once_and_each_caller_gets_its_own_attributes(flowgrpo_home, tmp_path):
    folder = ensure_qwen2_tokenizer()
    shutil.copytree(folder, tmp_path / "same_files")
    first, second = load_tokenizer(folder), load_tokenizer(tmp_path / "same_files")
    assert first is not second
    assert first.backend_tokenizer is second.backend_tokenizer
    first.model_max_length = 7
    assert second.model_max_length != 7
    assert load_tokenizer(folder).model_max_length == second.model_max_length


def test_a_rewritten_folder_loads_afresh(flowgrpo_home, tmp_path):
    folder = tmp_path / "tokenizer"
    shutil.copytree(ensure_qwen2_tokenizer(), folder)
    before = load_tokenizer(folder)
    config = folder / "tokenizer_config.json"
    config.write_text(config.read_text().replace('"model_max_length": 131072', '"model_max_length": 64'))
    after = load_tokenizer(folder)
    assert after.backend_tokenizer is not before.backend_tokenizer
    assert after.model_max_length == 64


def test_processors_sharing_a_backend_never_encode_at_once(flowgrpo_home):
    # Two families' processors over one folder share the Rust backend, and each reconfigures its
    # truncation on every call (Qwen-Image: 1058 tokens, Wan: 512); encoding while the other processor
    # encodes raises "RuntimeError: Already borrowed" or truncates with the other's setting. So while
    # one processor encodes, the other waits.
    folder = ensure_qwen2_tokenizer()
    qwen = QwenImageTextProcessor({"tokenizer": load_tokenizer(folder)})
    wan = WanTextProcessor({"tokenizer": load_tokenizer(folder)})
    with ThreadPoolExecutor(1) as pool:
        with qwen._lock:
            waiting = pool.submit(wan.tokenize, ["a prompt"])
            done, _ = wait([waiting], timeout=0.5)
            assert not done, "the Wan processor encoded while the Qwen-Image processor held the backend"
        assert waiting.result(timeout=30)[0].token_ids["tokenizer"].numel() > 0
