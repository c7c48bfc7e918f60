"""Greedy generation through vLLM's offline engine, in a process of its own (vLLM owns the process: one engine
per run). Reads a JSON job from argv[1], prints one line "RESULT <json>": per prompt the new token ids and the
logit vLLM computed for each (raw_logits). The engine runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0)."""
import json
import os
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main() -> None:
    job = json.loads(sys.argv[1])
    from vllm import LLM, SamplingParams

    llm = LLM(model=job["folder"], tokenizer=job["folder"], dtype=job.get("dtype", "float32"),
              enforce_eager=job["mode"] == "eager", max_model_len=job.get("max_model_len", 256), max_num_seqs=8,
              seed=0, tensor_parallel_size=job.get("tp", 1),
              logprobs_mode="raw_logits")  # the logits themselves: no softmax over a padded vocabulary
    quant = llm.llm_engine.vllm_config.model_config.quantization
    if job.get("teacher_forced"):  # the logits of every prompt position: vLLM's top-1 and the next prompt token's
        sp = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
        res = llm.generate([{"prompt_token_ids": p} for p in job["teacher_forced"]], sp, use_tqdm=False)
        outs = []
        for p, r in zip(job["teacher_forced"], res):
            positions = r.prompt_logprobs[1:]
            outs.append({"top": [min(d.items(), key=lambda kv: kv[1].rank)[0] for d in positions],
                         "next": [d[t].logprob for d, t in zip(positions, p[1:])]})
        print("RESULT " + json.dumps({"quantization": quant, "outputs": outs}), flush=True)
        return
    sp = SamplingParams(temperature=0, max_tokens=job["new_tokens"], ignore_eos=True, logprobs=1)
    outs = []
    for batch in job["batches"]:  # prompts of one batch are decoded together (several tokens per step)
        res = llm.generate([{"prompt_token_ids": p} for p in batch], sp, use_tqdm=False)
        for r in res:
            c = r.outputs[0]
            outs.append({"tokens": list(c.token_ids),
                         "logits": [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)]})
    print("RESULT " + json.dumps({"quantization": quant, "outputs": outs}), flush=True)


if __name__ == "__main__":
    main()
