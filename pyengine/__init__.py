"""The engine: config, loaders, tokenizer, models, quantization, KV cache, scheduler, sampler, runner."""
