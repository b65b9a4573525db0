"""Model sources a user names (hub ids through a local HF cache, folders, config.json files),
vision-language configs, the device default and bad input, through the real CLI.

No network here: hub-id tests lay out a cache the way huggingface_hub writes it
(``models--owner--name/{refs/main, snapshots/<commit>/config.json}``) and run the CLI with
``HF_HUB_OFFLINE=1``; huggingface_hub itself resolves the file."""

import json
import os
import shutil
import subprocess
import time
import sys

import pytest

from memguard_core.cli import default_device
from memguard_core.errors import ConfigError
from memguard_core.estimator.estimate import estimate
from memguard_core.sources import looks_like_hub_id, resolve_model_config
from memguard_core.estimator.config_fields import image_tokens_per_image
from memguard_core.estimator.specs import TrainSpec
from memguard_core.estimator.trainable import check_train_spec, trainable_params
from memguard_hf.model_spec import model_spec_from_hf_config

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SMOL = os.path.join(HERE, "configs", "smollm2-135m.json")
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _lay_out_cache(cache: str, repo: str, config_path: str, ref: str = "main") -> str:
    """Write ``config_path`` into ``cache`` as huggingface_hub stores a downloaded file."""
    folder = os.path.join(cache, "models--" + repo.replace("/", "--"))
    snap = os.path.join(folder, "snapshots", COMMIT)
    os.makedirs(snap, exist_ok=True)
    os.makedirs(os.path.join(folder, "refs"), exist_ok=True)
    with open(os.path.join(folder, "refs", ref), "w") as fh:
        fh.write(COMMIT)
    shutil.copy(config_path, os.path.join(snap, "config.json"))
    return os.path.join(snap, "config.json")


def _cli(*args, env=None):
    e = dict(os.environ, **(env or {}))
    e["PYTHONPATH"] = ROOT + os.pathsep + e.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-m", "memguard_core.cli", "estimate", *args],
                          capture_output=True, text=True, env=e, timeout=300)


def _cli_here(capsys, *args):
    """``memguard estimate *args`` in this process (for cases that need no environment of their
    own: huggingface_hub reads HF_HOME / HF_HUB_OFFLINE at import): (exit code, stdout, stderr)."""
    from memguard_core.cli import main

    code = main(["estimate", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_hub_id_resolves_from_the_hf_hub_cache_offline(tmp_path, capsys):
    cache = str(tmp_path / "hub")
    _lay_out_cache(cache, "HuggingFaceTB/SmolLM2-135M", SMOL)
    env = {"HF_HUB_CACHE": cache, "HF_HUB_OFFLINE": "1"}
    by_id = _cli("HuggingFaceTB/SmolLM2-135M", "--json", "--device", "cpu", env=env)
    assert by_id.returncode == 0, by_id.stderr
    code, by_path, err = _cli_here(capsys, "--config", SMOL, "--json", "--device", "cpu")
    assert code == 0, err
    a, b = json.loads(by_id.stdout), json.loads(by_path)
    assert a["peak_bytes"] == b["peak_bytes"] > 0
    assert a["model"]["num_layers"] == 30


def test_hub_id_under_hf_home_and_a_revision(tmp_path):
    home = tmp_path / "hf"
    _lay_out_cache(str(home / "hub"), "acme/tiny", SMOL, ref="v1")
    env = {"HF_HOME": str(home), "HF_HUB_OFFLINE": "1"}
    env.pop("HF_HUB_CACHE", None)
    e = {k: v for k, v in os.environ.items() if k != "HF_HUB_CACHE"}
    e.update(env)
    e["PYTHONPATH"] = ROOT
    p = subprocess.run([sys.executable, "-m", "memguard_core.cli", "estimate", "acme/tiny", "--revision", "v1",
                        "--json", "--device", "cpu"], capture_output=True, text=True, env=e, timeout=300)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["model"]["hidden_size"] == 576
    # the default branch was never downloaded: offline, that is a clear error, not a traceback
    p = subprocess.run([sys.executable, "-m", "memguard_core.cli", "estimate", "acme/tiny", "--device", "cpu"],
                       capture_output=True, text=True, env=e, timeout=300)
    assert p.returncode == 2
    assert "MODEL" in p.stderr and "HF_HUB_OFFLINE" in p.stderr and "Traceback" not in p.stderr


def test_uncached_hub_id_offline_names_the_argument(tmp_path):
    p = _cli("Qwen/Qwen2.5-7B-Instruct", env={"HF_HUB_CACHE": str(tmp_path), "HF_HUB_OFFLINE": "1"})
    assert p.returncode == 2
    assert "invalid MODEL" in p.stderr and "Qwen/Qwen2.5-7B-Instruct" in p.stderr
    assert "Traceback" not in p.stderr


def test_a_cached_hub_id_resolves_without_asking_an_unreachable_hub(tmp_path):
    # online mode, no network: the cache is read first, the hub never asked (issue 34 item 5)
    cache = str(tmp_path / "hub")
    _lay_out_cache(cache, "HuggingFaceTB/SmolLM2-135M", SMOL)
    env = {"HF_HUB_CACHE": cache, "HF_HUB_OFFLINE": "0", "HF_ENDPOINT": "http://127.0.0.1:9"}
    p = _cli("HuggingFaceTB/SmolLM2-135M", "--json", "--device", "cpu", env=env)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["model"]["num_layers"] == 30


def test_an_uncached_hub_id_with_the_hub_unreachable_is_one_attempt_and_one_line(tmp_path):
    # huggingface_hub alone retries with backoff for ~25 s and warns at each retry (issue 34 item 5)
    env = {"HF_HUB_CACHE": str(tmp_path), "HF_HUB_OFFLINE": "0", "HF_ENDPOINT": "http://127.0.0.1:9"}
    t0 = time.monotonic()
    p = _cli("Qwen/Qwen2.5-7B-Instruct", env=env)
    assert time.monotonic() - t0 < 20
    assert p.returncode == 2 and "Retry" not in p.stderr and "Traceback" not in p.stderr
    assert "the hub cannot be reached" in p.stderr and len(p.stderr.strip().splitlines()) == 1


def test_local_folder_and_file_and_both_sources(tmp_path):
    shutil.copy(SMOL, tmp_path / "config.json")
    assert resolve_model_config(str(tmp_path)) == str(tmp_path / "config.json")
    assert resolve_model_config(SMOL) == SMOL
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match="config.json"):
        resolve_model_config(str(empty))
    with pytest.raises(ConfigError, match="MODEL"):
        resolve_model_config("./no/such/file.json")
    p = _cli(str(tmp_path), "--config", SMOL)
    assert p.returncode == 2 and "--config" in p.stderr


def test_hub_id_shape():
    assert looks_like_hub_id("Qwen/Qwen2.5-7B-Instruct") and looks_like_hub_id("gpt2")
    for path in ("./model", "../x/y", "~/m", "a/b/c", "config.json", "a--b/c"):
        assert not looks_like_hub_id(path), path


# -- vision-language models ------------------------------------------------------------------

QWEN2_VL_2B = dict(  # Qwen/Qwen2-VL-2B-Instruct config.json: the text and vision numbers
    model_type="qwen2_vl", torch_dtype="bfloat16", tie_word_embeddings=True,
    text_config=dict(model_type="qwen2_vl_text", hidden_size=1536, intermediate_size=8960,
                     num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                     vocab_size=151936, max_position_embeddings=32768, tie_word_embeddings=True),
    vision_config=dict(depth=32, embed_dim=1280, hidden_size=1536, mlp_ratio=4, num_heads=16,
                       patch_size=14, spatial_merge_size=2, temporal_patch_size=2, in_channels=3),
)


def test_qwen2_vl_counts_its_vision_tower_and_image_tokens():
    ms = model_spec_from_hf_config(QWEN2_VL_2B)
    assert ms.num_layers == 28 and ms.hidden_size == 1536
    # Qwen2-VL-2B: 1.54 B language model (tied head) + 0.67 B vision tower and merger
    assert 0.6e9 < ms.params.vision < 0.7e9
    assert 2.1e9 < ms.total_params < 2.3e9
    assert ms.image_tokens == 256  # 448 x 448 px / (14 px patches x 2 x 2 merge)
    assert all(lin.in_features in (1536, 8960) for lin in ms.block_linears)  # the LM's linears only
    lora = TrainSpec(method="lora", lora_targets=("all-linear",), dtype="bf16")
    full = TrainSpec(method="full", dtype="bf16")
    assert trainable_params(ms, lora) < 0.05e9  # the vision tower stays frozen under LoRA
    assert trainable_params(ms, full) == ms.total_params


def test_image_tokens_lengthen_the_language_models_sequence():
    ms = model_spec_from_hf_config(QWEN2_VL_2B)
    text = estimate(ms, TrainSpec(batch_size=2, seq_length=512, dtype="bf16", device="cuda"))
    with_img = estimate(ms, TrainSpec(batch_size=2, seq_length=512, image_tokens=256, dtype="bf16",
                                      device="cuda"))
    same = estimate(ms, TrainSpec(batch_size=2, seq_length=768, dtype="bf16", device="cuda"))
    assert with_img.peak_bytes == same.peak_bytes > text.peak_bytes
    assert with_img.train_spec.seq_length == 512 and with_img.train_spec.image_tokens == 256


def test_vlm_cli_defaults_to_one_image_per_row(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(QWEN2_VL_2B))
    one = json.loads(_cli_here(capsys, str(path), "--json", "--device", "cuda")[1])
    none = json.loads(_cli_here(capsys, str(path), "--json", "--device", "cuda", "--image-tokens", "0")[1])
    assert one["train"]["image_tokens"] == 256 and none["train"]["image_tokens"] == 0
    assert one["peak_bytes"] > none["peak_bytes"]


@pytest.mark.parametrize("model_type,tokens", [
    ("llava", 576),        # CLIP ViT-L/14 at 336 px: 24 x 24 patches, CLS dropped ("default")
    ("gemma3", 256),       # mm_tokens_per_image
    ("mllama", 0),         # cross-attention: the decoder's sequence does not grow
    ("smolvlm", 17 * 12),  # 4 x 4 tiles + the global view, pixel shuffle (scale_factor 2)
])
def test_vision_language_families_build_and_count(model_type, tokens):
    from transformers import AutoConfig

    cfg = AutoConfig.for_model(model_type)
    assert image_tokens_per_image(cfg) == tokens
    ms = model_spec_from_hf_config(cfg)
    assert ms.params.vision > 0 and ms.image_tokens == tokens


def test_live_vision_language_module_counts_the_same():
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText

    from memguard_torch.module_spec import model_spec_from_module

    small = json.loads(json.dumps(QWEN2_VL_2B))
    small["text_config"].update(num_hidden_layers=2, hidden_size=128, intermediate_size=256,
                                num_attention_heads=4, num_key_value_heads=2, vocab_size=1000)
    small["vision_config"].update(depth=2, embed_dim=64, hidden_size=128, num_heads=4)
    cfg = AutoConfig.for_model(small.pop("model_type"), **small)
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(cfg)
    live = model_spec_from_module(model)
    from_cfg = model_spec_from_hf_config(cfg)
    assert live.params.vision == from_cfg.params.vision == sum(
        p.numel() for n, p in model.named_parameters() if ".visual." in f".{n}")
    assert live.image_tokens == 256


# -- the device default ----------------------------------------------------------------------

class _FakeTorchCuda:
    """Thin stand-in for ``torch.cuda`` (no GPU on this machine): only ``is_available``."""

    def __init__(self, available):
        self.available = available

    def is_available(self):
        return self.available


def test_device_default_follows_what_this_machine_would_train_on(capsys):
    assert default_device("hf", torch_cuda=_FakeTorchCuda(True)) == "cuda"
    assert default_device("lightning", torch_cuda=_FakeTorchCuda(False)) == "cpu"
    assert default_device("mlx", torch_cuda=_FakeTorchCuda(True)) == "mlx"
    # without torch imported: the driver's GPU count, and CUDA_VISIBLE_DEVICES hiding them
    code = ("import sys; from memguard_core.cli import default_device as d; "
            "print(d('hf', nvidia_gpus=2), d('hf', nvidia_gpus=0), 'torch' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, PYTHONPATH=ROOT, CUDA_VISIBLE_DEVICES="0"))
    assert r.stdout.split() == ["cuda", "cpu", "False"], r.stderr
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, PYTHONPATH=ROOT, CUDA_VISIBLE_DEVICES="-1"))
    assert r.stdout.split() == ["cpu", "cpu", "False"], r.stderr
    import torch

    assert default_device("hf") == ("cuda" if torch.cuda.is_available() else "cpu")
    code, out, err = _cli_here(capsys, "--config", SMOL, "--json")
    assert code == 0, err
    assert json.loads(out)["counter"] == default_device("hf")
    code, table, err = _cli_here(capsys, "--config", SMOL)
    expected = "peak RSS" if default_device("hf") == "cpu" else "peak device memory"
    assert code == 0 and "predicts" in table and expected in " ".join(table.split())


# -- bad input -------------------------------------------------------------------------------

def _write(tmp_path, **over):
    d = json.load(open(SMOL))
    d.update(over)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(d))
    return str(path)


def test_heads_not_dividing_hidden_size_is_a_clear_error(tmp_path, capsys):
    code, _, err = _cli_here(capsys, "--config", _write(tmp_path, num_attention_heads=7, head_dim=None),
                             "--device", "cpu")
    assert code == 2 and "num_attention_heads" in err and "576" in err
    assert "Traceback" not in err
    code, _, err = _cli_here(capsys, "--config", _write(tmp_path, num_attention_heads=9, num_key_value_heads=2),
                             "--device", "cpu")
    assert code == 2 and "num_key_value_heads" in err


def test_lora_rank_and_layers_beyond_the_model(tmp_path, capsys):
    # one above the widest LoRA'd layer (PEFT's default targets q_proj, v_proj: q_proj is 576 -> 576):
    # the boundary itself; the CLI builds the adapted model on the way, so a huge rank costs minutes
    code, _, err = _cli_here(capsys, "--config", SMOL, "--lora-rank", "577", "--device", "cpu")
    assert code == 2 and "--lora-rank" in err and "576 -> 576" in err and "Traceback" not in err
    code, _, err = _cli_here(capsys, "--config", SMOL, "--lora-layers", "31", "--device", "cpu")
    assert code == 2 and "--lora-layers" in err and "30 blocks" in err
    ms = model_spec_from_hf_config(SMOL)
    # k_proj of SmolLM2-135M is 576 -> 192 (3 KV heads x 64): rank 256 runs, with a warning
    warns = check_train_spec(ms, TrainSpec(lora_rank=256, lora_targets=("all-linear",)))
    assert any("k_proj" in w and "192" in w for w in warns)
    assert check_train_spec(ms, TrainSpec(lora_rank=16, lora_targets=("all-linear",))) == []


def test_sequence_beyond_the_position_table_warns(tmp_path, capsys):
    ms = model_spec_from_hf_config(SMOL)
    assert ms.max_position_embeddings == 8192
    est = estimate(ms, TrainSpec(seq_length=9000))
    assert any("max_position_embeddings" in n for n in est.notes)
    code, out, _ = _cli_here(capsys, "--config", SMOL, "--seq-length", "9000", "--json", "--device", "cpu")
    assert code == 0
    assert any("max_position_embeddings (8192)" in n for n in json.loads(out)["notes"])


def test_a_folder_whose_config_cannot_be_read_says_why(tmp_path):
    # issue 34: an unreadable model folder was reported as having no config.json
    (tmp_path / "config.json").symlink_to(tmp_path / "gone.json")
    with pytest.raises(ConfigError) as e:
        resolve_model_config(str(tmp_path))
    assert "a link to nothing" in str(e.value) and e.value.field == "MODEL"
    (tmp_path / "config.json").unlink()
    (tmp_path / "config.json").mkdir()
    with pytest.raises(ConfigError, match="it is a folder"):
        resolve_model_config(str(tmp_path))
