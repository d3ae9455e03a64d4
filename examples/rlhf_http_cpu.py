"""vLLM's RLHF-over-HTTP flow on CPU, with gloo instead of NCCL.

It starts `rlserve serve` on SmolLM2-135M-Instruct's config with dummy weights, shows its
nonsense output, pushes the real weights from a trainer-side model over gloo with the exact
HTTP choreography of vLLM's RLHF-over-HTTP example, and shows the output again -- now the
real model's, checked token for token against transformers. Then it stops the server.

    python examples/rlhf_http_cpu.py [--port 8000] [--model DIR]
"""

from __future__ import annotations

import argparse
import sys
import threading
import time

import requests
import torch
from openai import OpenAI
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlserve.model.demo_model import demo_model_path
from rlserve.server.launcher import ServerProcess
from rlserve.weight_transfer import GlooWeightTransferEngine, get_open_port, rendezvous_address

PROMPTS = [
    "Hello, my name is",
    "The president of the United States is",
    "The capital of France is",
    "The future of AI is",
]
MAX_TOKENS = 32


def generate_completions(client: OpenAI, model: str, prompts: list[str]) -> list[str]:
    return [client.completions.create(model=model, prompt=p, max_tokens=MAX_TOKENS,
                                      temperature=0).choices[0].text for p in prompts]


def init_weight_transfer_engine(base_url, master_address, master_port, rank_offset, world_size):
    payload = {"init_info": dict(master_address=master_address, master_port=master_port,
                                 rank_offset=rank_offset, world_size=world_size)}
    requests.post(f"{base_url}/init_weight_transfer_engine", json=payload, timeout=60).raise_for_status()


def update_weights(base_url, names, dtype_names, shapes, packed=False):
    payload = {"update_info": dict(names=names, dtype_names=dtype_names, shapes=shapes, packed=packed)}
    requests.post(f"{base_url}/update_weights", json=payload, timeout=300).raise_for_status()


def start_server(model: str, port: int) -> ServerProcess:
    return ServerProcess(model, "--device", "cpu", "--dtype", "float32", "--load-format", "dummy",
                         "--max-model-len", "512", "--served-model-name", "smollm2",
                         "--weight-transfer-config", '{"backend": "gloo"}', port=port, timeout_s=180)


def reference_greedy(model, tokenizer, prompt: str) -> str:
    ids, past, out = torch.tensor([tokenizer.encode(prompt)]), None, []
    with torch.no_grad():
        for _ in range(MAX_TOKENS):
            step = model(ids, past_key_values=past, use_cache=True)
            past = step.past_key_values
            tok = int(step.logits[0, -1].argmax())
            out.append(tok)
            ids = torch.tensor([[tok]])
            if tok == tokenizer.eos_token_id:
                break
    return tokenizer.decode(out, skip_special_tokens=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, default=None)
    parser.add_argument("--model", default=None, help="HF directory (default: the demo model)")
    args = parser.parse_args()
    model_path = args.model or demo_model_path()
    port = args.port or get_open_port()
    base_url = f"http://127.0.0.1:{port}"

    server = start_server(model_path, port)
    try:
        inference_world_size = requests.get(f"{base_url}/get_world_size", timeout=10).json()["world_size"]
        world_size = inference_world_size + 1  # +1 for the trainer

        print(f"Loading training model: {model_path}")
        train_model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(model_path)
        client = OpenAI(base_url=f"{base_url}/v1", api_key="EMPTY")

        print("-" * 50 + "\nGenerating text BEFORE weight update (expect nonsense):\n" + "-" * 50)
        before = generate_completions(client, "smollm2", PROMPTS)
        for prompt, text in zip(PROMPTS, before):
            print(f"Prompt: {prompt!r}\nGenerated text: {text!r}\n" + "-" * 50)

        # vLLM's example calls get_ip(); the local address on the route to the server keeps a
        # group with a server on this host on loopback.
        master_address, master_port, rank_offset = rendezvous_address(base_url), get_open_port(), 1
        print(f"Initializing weight transfer: master={master_address}:{master_port}")
        init_thread = threading.Thread(target=init_weight_transfer_engine,
                                       args=(base_url, master_address, master_port, rank_offset, world_size))
        init_thread.start()
        group = GlooWeightTransferEngine.trainer_init(
            dict(master_address=master_address, master_port=master_port, world_size=world_size))
        init_thread.join()

        requests.post(f"{base_url}/pause", timeout=60).raise_for_status()
        names, dtype_names, shapes = [], [], []
        for name, p in train_model.named_parameters():
            names.append(name)
            dtype_names.append(str(p.dtype).split(".")[-1])
            shapes.append(list(p.shape))
        update_thread = threading.Thread(target=update_weights,
                                         args=(base_url, names, dtype_names, shapes, True))
        update_thread.start()
        print("Broadcasting weights via gloo...")
        t0 = time.perf_counter()
        GlooWeightTransferEngine.trainer_send_weights(
            iterator=train_model.named_parameters(), group=group, packed=True)
        update_thread.join()
        print(f"Pushed {sum(p.numel() * p.element_size() for p in train_model.parameters()) / 1e6:.0f} MB "
              f"in {time.perf_counter() - t0:.2f} s")
        requests.post(f"{base_url}/resume", timeout=60).raise_for_status()

        print("-" * 50 + "\nGenerating text AFTER weight update:\n" + "-" * 50)
        after = generate_completions(client, "smollm2", PROMPTS)
        matches = 0
        for prompt, text in zip(PROMPTS, after):
            ref = reference_greedy(train_model, tokenizer, prompt)
            matches += text == ref
            print(f"Prompt: {prompt!r}\nGenerated text: {text!r}\n"
                  f"transformers:   {ref!r}  {'(same)' if text == ref else '(DIFFERENT)'}\n" + "-" * 50)
        print(f"{matches}/{len(PROMPTS)} outputs equal transformers' greedy output on the pushed weights")
        return 0 if matches == len(PROMPTS) else 1
    finally:
        server.stop()


if __name__ == "__main__":
    sys.exit(main())
