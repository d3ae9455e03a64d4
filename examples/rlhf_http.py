"""vLLM's RLHF-over-HTTP flow against rlserve, with NCCL: the server on GPU 0..N-1, the
trainer on GPU N. Only the imports differ from the original script, and the group's address:
the local address on the route to the server (loopback for a local one), where vLLM's example
calls get_ip() (which rlserve keeps, honouring $VLLM_HOST_IP as vLLM does).

    rlserve serve facebook/opt-125m --enforce-eager --load-format dummy \
        --weight-transfer-config '{"backend": "nccl"}'
    python examples/rlhf_http.py

The output before the update is nonsense (dummy weights); after it, the real model's.
BASE_URL, MODEL and TRAIN_DTYPE in the environment change the server, the model (a hub id or
a directory) and the trainer's dtype (bfloat16, as in vLLM's example).
"""

import os
import threading

import requests
import torch
from openai import OpenAI
from transformers import AutoModelForCausalLM

from rlserve.weight_transfer import NCCLWeightTransferEngine, get_open_port, rendezvous_address

BASE_URL = os.environ.get("BASE_URL", "http://localhost:8000")
MODEL_NAME = os.environ.get("MODEL", "facebook/opt-125m")
TRAIN_DTYPE = getattr(torch, os.environ.get("TRAIN_DTYPE", "bfloat16"))


def generate_completions(client: OpenAI, model: str, prompts: list[str]) -> list[str]:
    results = []
    for prompt in prompts:
        response = client.completions.create(model=model, prompt=prompt, max_tokens=32, temperature=0)
        results.append(response.choices[0].text)
    return results


def init_weight_transfer_engine(base_url, master_address, master_port, rank_offset, world_size) -> None:
    payload = {"init_info": dict(master_address=master_address, master_port=master_port,
                                 rank_offset=rank_offset, world_size=world_size)}
    requests.post(f"{base_url}/init_weight_transfer_engine", json=payload, timeout=60).raise_for_status()


def update_weights(base_url, names, dtype_names, shapes, packed=False) -> None:
    payload = {"update_info": dict(names=names, dtype_names=dtype_names, shapes=shapes, packed=packed)}
    requests.post(f"{base_url}/update_weights", json=payload, timeout=300).raise_for_status()


def pause_generation(base_url: str) -> None:
    requests.post(f"{base_url}/pause", timeout=60).raise_for_status()


def resume_generation(base_url: str) -> None:
    requests.post(f"{base_url}/resume", timeout=60).raise_for_status()


def get_world_size(base_url: str) -> int:
    response = requests.get(f"{base_url}/get_world_size", timeout=10)
    response.raise_for_status()
    return response.json()["world_size"]


def main():
    inference_world_size = get_world_size(BASE_URL)
    world_size = inference_world_size + 1  # +1 for the trainer
    device = f"cuda:{inference_world_size}"
    torch.cuda.set_device(device)

    print(f"Loading training model: {MODEL_NAME}")
    train_model = AutoModelForCausalLM.from_pretrained(MODEL_NAME, dtype=TRAIN_DTYPE)
    train_model.to(device)
    client = OpenAI(base_url=f"{BASE_URL}/v1", api_key="EMPTY")
    prompts = ["Hello, my name is", "The president of the United States is",
               "The capital of France is", "The future of AI is"]

    print("-" * 50 + "\nGenerating text BEFORE weight update (expect nonsense):\n" + "-" * 50)
    for prompt, text in zip(prompts, generate_completions(client, MODEL_NAME, prompts)):
        print(f"Prompt: {prompt!r}\nGenerated text: {text!r}\n" + "-" * 50)

    # vLLM's example calls get_ip(); the local address on the route to the server keeps a
    # group with a server on this host on loopback.
    master_address, master_port, rank_offset = rendezvous_address(BASE_URL), get_open_port(), 1
    print(f"Initializing weight transfer: master={master_address}:{master_port}")
    init_thread = threading.Thread(target=init_weight_transfer_engine,
                                   args=(BASE_URL, master_address, master_port, rank_offset, world_size))
    init_thread.start()
    model_update_group = NCCLWeightTransferEngine.trainer_init(
        dict(master_address=master_address, master_port=master_port, world_size=world_size))
    init_thread.join()

    pause_generation(BASE_URL)
    names, dtype_names, shapes = [], [], []
    for name, p in train_model.named_parameters():
        names.append(name)
        dtype_names.append(str(p.dtype).split(".")[-1])
        shapes.append(list(p.shape))
    update_thread = threading.Thread(target=update_weights,
                                     args=(BASE_URL, names, dtype_names, shapes, True))
    update_thread.start()
    print("Broadcasting weights via NCCL...")
    NCCLWeightTransferEngine.trainer_send_weights(iterator=train_model.named_parameters(),
                                                  group=model_update_group, packed=True)
    update_thread.join()
    resume_generation(BASE_URL)

    print("-" * 50 + "\nGenerating text AFTER weight update:\n" + "-" * 50)
    for prompt, text in zip(prompts, generate_completions(client, MODEL_NAME, prompts)):
        print(f"Prompt: {prompt!r}\nGenerated text: {text!r}\n" + "-" * 50)


if __name__ == "__main__":
    main()
