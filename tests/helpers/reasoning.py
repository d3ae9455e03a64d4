"""A thinking model's chat template and the flags of `vllm serve` the reasoning, flag and
request-field tests start their one server with (conftest.py: think_model, flags_server)."""

from __future__ import annotations

# A thinking model's chat template, in Qwen3's manner: reasoning of past turns in <think>,
# and with enable_thinking false an empty think block closes the thinking in the prompt.
THINK_TEMPLATE = """\
{%- for message in messages %}<|im_start|>{{ message.role }}
{% if message.role == "assistant" and message.reasoning_content %}<think>
{{ message.reasoning_content }}
</think>

{% endif %}{{ message.content or "" }}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% endif %}{% endif %}"""

# Every flag of `vllm serve` that rlserve accepts without a model-specific meaning, at once.
VLLM_FLAGS = ("--reasoning-parser", "qwen3", "--enable-prompt-tokens-details",
              "--enable-force-include-usage", "--root-path", "/gateway",
              "--enable-tokenizer-info-endpoint", "--enable-server-load-tracking",
              "--enable-per-request-metrics", "--show-hidden-metrics-for-version", "0.10",
              "--structured-outputs-config.backend", "xgrammar",
              "--watermark-config", '{"watermark_alpha": 0.5}', "--enable-auto-tool-choice",
              "--enable-sleep-mode")
