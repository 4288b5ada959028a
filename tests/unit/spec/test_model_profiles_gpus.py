from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from helixserve.errors import UserError
from helixserve.spec import Curve, load_gpu_catalog, load_model, load_profiles

SHARED = Path(__file__).resolve().parents[2] / "data" / "shared"


def test_llama_2_70b_sizes_by_hand():
    m = load_model(SHARED / "models" / "llama-2-70b")
    assert m.name == "llama-2-70b"  # the directory name
    assert (m.num_layers, m.hidden_size, m.num_key_value_heads, m.head_dim) == (80, 8192, 8, 128)
    # q, o: 8192x8192; k, v: 8192x1024; gate/up/down: 8192x28672; two norms
    params = 2 * 8192 * 8192 + 2 * 8192 * 1024 + 3 * 8192 * 28672 + 2 * 8192
    assert m.layer_weight_bytes == 2 * params == 1_711_308_800
    assert m.kv_bytes_per_token_per_layer == 2 * 8 * 128 * 2
    assert m.activation_bytes_per_token == 8192 * 2
    assert m.embedding_weight_bytes == (2 * 32000 * 8192 + 8192) * 2


def test_llama_30b_has_no_gqa_and_name_override():
    m = load_model(SHARED / "models" / "llama-30b" / "config.json", name="l30")
    assert m.name == "l30"
    assert m.num_key_value_heads == 52
    assert m.kv_bytes_per_token_per_layer == 2 * 6656 * 2


def test_tied_embeddings_count_once(tmp_path):
    cfg = {"hidden_size": 576, "intermediate_size": 1536, "num_attention_heads": 9,
           "num_key_value_heads": 3, "num_hidden_layers": 30, "vocab_size": 49152,
           "max_position_embeddings": 8192, "tie_word_embeddings": True}
    (tmp_path / "smol").mkdir()
    (tmp_path / "smol" / "config.json").write_text(json.dumps(cfg))
    m = load_model(tmp_path / "smol")
    assert m.name == "smol" and m.head_dim == 64
    assert m.embedding_weight_bytes == (49152 * 576 + 576) * 2


def test_model_errors(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 64}))
    with pytest.raises(UserError, match=r"config\.json: num_attention_heads: bad value None"):
        load_model(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(UserError, match="not valid JSON"):
        load_model(tmp_path)


def test_shared_profiles_load_every_curve():
    table = load_profiles(SHARED / "profiles" / "helix-measured.csv")
    assert len(table.curves) == 28  # 2 models x 7 machines x 2 phases
    assert table.head_curves == {}  # a file without the part column: layer rows only
    assert table.has("llama-2-70b", "T4", 4)
    assert not table.has("llama-2-70b", "H100-80GB", 1)
    c = table.curve("llama-2-70b", "A100-40GB", 1, "decode")
    assert c is not None and c.batch_tokens[0] == 2 and c.layer_ms[0] == 1.4
    assert list(c.batch_tokens) == sorted(c.batch_tokens)


def test_part_column_is_optional_and_keeps_head_rows_apart(tmp_path):
    p = tmp_path / "p.csv"
    p.write_text("model,gpu,num_gpus,phase,batch_tokens,layer_ms,part\n"
                 "m,L4,1,decode,1,2.0,layer\nm,L4,1,decode,1,0.5,head\nm,L4,1,decode,8,0.7,head\n"
                 "m,L4,1,prompt,64,3.0,\n")  # an empty part is a layer row
    table = load_profiles(p)
    assert table.curve("m", "L4", 1, "decode") == Curve((1,), (2.0,))
    assert table.curve("m", "L4", 1, "prompt") == Curve((64,), (3.0,))
    assert table.head_curve("m", "L4", 1, "decode") == Curve((1, 8), (0.5, 0.7))
    assert table.head_curve("m", "L4", 1, "prompt") is None
    assert table.has("m", "L4", 1)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("model,gpu,phase\n", "missing columns num_gpus, batch_tokens, layer_ms"),
        ("model,gpu,num_gpus,phase,batch_tokens,layer_ms\nm,L4,1,train,2,1.0\n",
         "line 2: phase: bad value 'train'"),
        ("model,gpu,num_gpus,phase,batch_tokens,layer_ms\nm,L4,1,decode,two,1.0\n",
         "line 2: batch_tokens: bad value 'two'; expected an integer"),
        ("model,gpu,num_gpus,phase,batch_tokens,layer_ms\nm,L4,1,decode,2,fast\n",
         "line 2: layer_ms: bad value 'fast'; expected a number"),
        ("model,gpu,num_gpus,phase,batch_tokens,layer_ms\nm,L4,1,decode,2,0\n",
         "line 2: layer_ms: bad value '0'; must be a finite number > 0"),
        ("model,gpu,num_gpus,phase,batch_tokens,layer_ms\nm,L4,1,decode,2,nan\n",
         "line 2: layer_ms: bad value 'nan'"),
        ("model,gpu,num_gpus,phase,batch_tokens,layer_ms\nm,L4,1,decode,2,inf\n",
         "line 2: layer_ms: bad value 'inf'"),
        ("model,gpu,num_gpus,phase,batch_tokens,layer_ms\nm,L4,0,decode,2,1.0\n",
         "line 2: num_gpus: bad value 0; must be >= 1"),
        ("model,gpu,num_gpus,phase,batch_tokens,layer_ms,part\nm,L4,1,decode,2,1.0,lm_head\n",
         "line 2: part: bad value 'lm_head'; known: layer, head"),
    ],
)
def test_profile_errors(tmp_path, text, message):
    p = tmp_path / "p.csv"
    p.write_text(text)
    with pytest.raises(UserError, match=message):
        load_profiles(p)


def test_catalog_ships_every_shared_gpu_and_cpu():
    shipped = load_gpu_catalog()
    shared = load_gpu_catalog(SHARED / "gpus.csv")
    assert set(shared.names()) <= set(shipped.names())
    assert "cpu" in shipped
    assert shipped.get("T4").dense_tflops == 65  # no bf16: fp16 rate
    with pytest.raises(UserError, match="unknown GPU 'B300'; known: A10, A100-40GB"):
        shipped.get("B300")


@pytest.mark.parametrize(("column", "value", "message"), [
    ("memory_bandwidth_gbytes_per_s", "0", "must be a finite number > 0"),
    ("memory_gb", "nan", "must be a finite number > 0"),
    ("fp16_dense_tflops", "-1", "must be a finite number > 0"),
    ("bf16_dense_tflops", "inf", "must be a finite number >= 0"),
])
def test_catalog_numbers_must_be_finite_and_positive(tmp_path, column, value, message):
    rows = list(csv.DictReader((SHARED / "gpus.csv").read_text().splitlines()))
    rows[0][column] = value
    p = tmp_path / "gpus.csv"
    with p.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    with pytest.raises(UserError, match=f"gpus.csv: line 2: {column}: bad value '{value}'; "
                                        f"{message}"):
        load_gpu_catalog(p)
