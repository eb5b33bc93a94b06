"""Reading Prometheus text as vLLM and the proxy expose it."""

from __future__ import annotations

from disagg.prometheus_text import sample_label, sample_sum

VLLM_TEXT = """\
# HELP vllm:nixl_bytes_transferred Bytes moved per transfer
# TYPE vllm:nixl_bytes_transferred histogram
vllm:nixl_bytes_transferred_sum{engine="0",model_name="tiny"} 131072.0
vllm:nixl_bytes_transferred_count{engine="0",model_name="tiny"} 1.0
# HELP vllm:prompt_tokens_by_source Prompt tokens by source
# TYPE vllm:prompt_tokens_by_source counter
vllm:prompt_tokens_by_source_total{engine="0",model_name="tiny",source="local_compute"} 104.0
vllm:prompt_tokens_by_source_total{engine="0",model_name="tiny",source="external_kv_transfer"} 2291.0
# HELP vllm:cache_config_info Cache config
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="128",engine="0"} 1.0
"""


def test_sum_with_and_without_labels() -> None:
    assert sample_sum(VLLM_TEXT, "vllm:nixl_bytes_transferred_sum") == 131072.0
    assert sample_sum(VLLM_TEXT, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") == 2291.0
    assert sample_sum(VLLM_TEXT, "vllm:prompt_tokens_by_source_total") == 2395.0
    assert sample_sum(VLLM_TEXT, "vllm:absent") == 0.0


def test_label_value() -> None:
    assert sample_label(VLLM_TEXT, "vllm:cache_config_info", "block_size") == "128"
    assert sample_label(VLLM_TEXT, "vllm:cache_config_info", "nope") is None
