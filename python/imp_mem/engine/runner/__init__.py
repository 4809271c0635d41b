"""The parts of the model runner (`imp_mem.engine.model_runner.ModelRunner`),
one concept a module: `buffers` (T2 and its host staging), `kv` (the KV
views and the runner's own blocks), `steps` (the prefills and the decode),
`graphs` (the warm-up and the decode's CUDA graphs). Each holds one base
class of `ModelRunner` and the functions and constants of its concept;
`model_runner` composes them and re-exports those names.
"""
