"""An OpenAI-compatible HTTP server for the bundled SmolLM2: ``python -m hf_kvint2.serve``.

transformers' own serving app (what ``transformers serve --continuous-batching`` runs: its FastAPI routes, request
handlers, tokenizing, streaming and cancellation, and the model's process with its continuous batching runner),
given a model this package builds instead of one it downloads: the bundled SmolLM2 (or, from Python, any model
object), on transformers' continuous batching with INT2 pages (``hf_kvint2.serving.enable_paged_int2``) or on the
stock paged cache (``--method none``, for comparison). One route is added: ``GET /v1/kv_cache``, the paged KV
cache's capacity and what is free.

How it plugs in: transformers' ``ModelManager`` asks a model loader for three things (``load_config`` and
``load_processor`` in the HTTP process, ``load_model_and_processor`` in the model's process, which gets the loader
pickled). :class:`ServedModel` is that loader for a model already chosen, so no model name is resolved on the Hub
and nothing is downloaded; the engine is switched on in the model's process, after the model loads. This calls
transformers' serving internals (``transformers.cli.serving``), which change between releases: the versions it was
tested on are ``TESTED_TRANSFORMERS``, and others are refused.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import re
import sys
import threading

# torch, transformers and the server's packages are imported after the arguments are parsed, so that --help prints
# at once.
METHODS = ("oscar", "oscar-scaled", "none")
TESTED_TRANSFORMERS = ("5.25",)  # major.minor of the transformers releases whose cli.serving this module drives
DEFAULT_KV_BUDGET = 512 * 2**20
DEFAULT_PORT = 8000
SERVE_INSTALL = "pip install 'hf_kvint2[serve]' (fastapi, uvicorn, openai)"
# The attribute of the model (in the model's process) that keeps its continuous batching manager, for /v1/kv_cache:
# transformers' runner holds the manager, and a function run in the model's process is only given the model.
MANAGER_ATTRIBUTE = "_hf_kvint2_batching_manager"
_BYTE_UNITS = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "kb": 10**3, "mb": 10**6, "gb": 10**9}


def parse_bytes(text: str) -> int:
    """``"536870912"``, ``"512MiB"``, ``"0.5 GiB"``, ``"500MB"`` -> bytes."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if unit not in _BYTE_UNITS:
        raise ValueError(f"Cannot read {text!r} as a size: write bytes (536870912) or a number with KiB, MiB, GiB, "
                         "KB, MB or GB (512MiB).")
    return int(float(match.group(1)) * _BYTE_UNITS[unit])


def check_transformers() -> None:
    """Refuse a transformers release whose serving internals this module was not tested on, or a missing server."""
    import transformers
    from transformers.utils.import_utils import is_serve_available

    release = ".".join(transformers.__version__.split(".")[:2])
    if release not in TESTED_TRANSFORMERS:
        raise RuntimeError(
            f"hf_kvint2.serve drives transformers' serving internals (transformers.cli.serving: ModelManager, "
            f"EngineClient, build_server), tested on transformers {', '.join(TESTED_TRANSFORMERS)}; this is "
            f"transformers {transformers.__version__}. Install transformers~={TESTED_TRANSFORMERS[-1]}.0.")
    if not is_serve_available():
        raise ImportError(f"The server needs transformers' serving dependencies: {SERVE_INSTALL}.")


def _given_model(model):
    return model


def _bundled_smollm2(dtype_name: str):
    import torch

    from .models import load_smollm2

    return load_smollm2(getattr(torch, dtype_name), attn_implementation="sdpa")[0]


def _shipped_oscar_cache(config):
    from .cache import OscarCache
    from .hub import SMOLLM2_ARTIFACT_ID

    return OscarCache.from_pretrained(SMOLLM2_ARTIFACT_ID, config=config)


def _oscar_scaled_cache(config):
    from .cache import OscarScaledCache

    return OscarScaledCache(config=config)


class ServedModel:
    """The model the server serves, as transformers' serving stack asks a model loader for it.

    Args:
        model_id: the name requests give in ``"model"`` (or leave out) and ``/v1/models`` lists.
        tokenizer: the model's tokenizer, with a chat template.
        config, generation_config: the model's configs (the HTTP process reads them; the model stays in its own
            process).
        dtype: the model's dtype (torch.dtype), which the stock engine's pages take.
        load_model: builds the model in the model's process (pickled there: a module-level function, or a
            ``functools.partial`` of one).
        method: ``"oscar"`` / ``"oscar-scaled"``: the INT2 paged engine with that cache; ``"none"``: the stock one.
        kv_budget_bytes: the KV cache's memory: the INT2 engine's ``kv_budget_bytes``; for the stock engine, the
            number of whole-model blocks (``ContinuousBatchingConfig.num_blocks``) that fit in it.
        cache_factory: ``cache_factory(config)`` -> the OscarCache / OscarScaledCache template of the INT2 engine
            (pickled too); defaults: the calibration shipped for SmolLM2, or a default OscarScaledCache.
        num_threads: torch's intra-op threads in the model's process (None: torch's default).
        expected_request_tokens: the INT2 engine's ``expected_request_tokens`` (the tokens, prompt and generated, of a
            typical request: its window slots are sized for as many as the budget holds); None: the engine's default.
    """

    def __init__(self, model_id: str, tokenizer, config, generation_config, dtype, load_model, method: str = "oscar",
                 kv_budget_bytes: int = DEFAULT_KV_BUDGET, cache_factory=None, num_threads: int | None = None,
                 expected_request_tokens: int | None = None):
        if method not in METHODS:
            raise ValueError(f"method={method!r} is not one of {METHODS}.")
        if method != "none" and importlib.util.find_spec("hf_kvint2.serving") is None:
            raise ImportError(f"method={method!r} runs the INT2 paged engine (hf_kvint2.serving), which this install "
                              "lacks; serve the stock engine with method 'none' (--method none).")
        if kv_budget_bytes <= 0:
            raise ValueError(f"kv_budget_bytes={kv_budget_bytes} must be positive.")
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError(f"The tokenizer of {model_id} has no chat template: /v1/chat/completions needs one. Set "
                             "tokenizer.chat_template.")
        self.model_id, self.tokenizer, self.dtype = model_id, tokenizer, dtype
        self.config, self.generation_config = config, generation_config
        self.load_model, self.method, self.num_threads = load_model, method, num_threads
        self.kv_budget_bytes, self.expected_request_tokens = kv_budget_bytes, expected_request_tokens
        self.cache_factory = cache_factory or (_oscar_scaled_cache if method == "oscar-scaled" else
                                               _shipped_oscar_cache)

    @classmethod
    def from_model(cls, model, tokenizer, model_id: str | None = None, **kwargs) -> ServedModel:
        """A model object (pickled into the model's process: meant for small models and tests)."""
        model_id = model_id or model.config.name_or_path or type(model).__name__
        return cls(model_id, tokenizer, model.config, model.generation_config, model.dtype,
                   functools.partial(_given_model, model), **kwargs)

    @classmethod
    def bundled_smollm2(cls, dtype: str = "float32", **kwargs) -> ServedModel:
        """The bundled SmolLM2-135M-Instruct: its config and tokenizer read here, its weights loaded in the model's
        process (from the safetensors copy of the GGUF file, written on first use)."""
        import torch
        from transformers import AutoConfig, AutoTokenizer, GenerationConfig

        from .models import DEFAULT_MODEL_ID, smollm2_checkpoint

        checkpoint = smollm2_checkpoint()
        return cls(DEFAULT_MODEL_ID, AutoTokenizer.from_pretrained(checkpoint), AutoConfig.from_pretrained(checkpoint),
                   GenerationConfig.from_pretrained(checkpoint), getattr(torch, dtype),
                   functools.partial(_bundled_smollm2, dtype), **kwargs)

    def continuous_batching_config(self, page_size: int | None = None, max_batch_tokens: int | None = None):
        """transformers' ``ContinuousBatchingConfig`` for this model: the stock engine gets its budget as
        ``num_blocks``; the INT2 engine sizes its pages itself from ``kv_budget_bytes``."""
        from transformers import ContinuousBatchingConfig

        options = {"max_batch_tokens": max_batch_tokens}
        if page_size is not None:
            options["page_size"] = page_size
        cb_config = ContinuousBatchingConfig(**options)
        if self.method == "none":
            cb_config.num_blocks = self.kv_budget_bytes // self.stock_bytes_per_block(cb_config.page_size)
            if cb_config.num_blocks < 1:
                raise ValueError(f"A KV budget of {self.kv_budget_bytes} bytes holds no block of {cb_config.page_size}"
                                 f" tokens ({self.stock_bytes_per_block(cb_config.page_size)} bytes): raise it.")
        return cb_config

    def stock_bytes_per_block(self, page_size: int) -> int:
        """Bytes of one whole-model block of the stock paged cache: ``page_size`` tokens of K and V in every layer,
        in the model's dtype (what ``ContinuousBatchingConfig.num_blocks`` counts)."""
        text = self.config.get_text_config()
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
        return page_size * text.num_hidden_layers * 2 * kv_heads * head_dim * self.dtype.itemsize

    # The three methods transformers' EngineClient calls on its model loader
    def load_config(self, model_id: str):
        return self.config, self.generation_config

    def load_processor(self, model_id: str):
        return self.tokenizer

    def load_model_and_processor(self, model_id: str, on_progress=None):
        """In the model's process: the model, on the engine of ``method``, and its tokenizer."""
        import torch

        if self.num_threads is not None:
            torch.set_num_threads(self.num_threads)
        model = self.load_model().eval()
        if self.method != "none":
            enable_int2_engine(model, self.cache_factory(model.config), self.kv_budget_bytes,
                               self.expected_request_tokens)
        keep_batching_manager(model)
        return model, self.tokenizer


def enable_int2_engine(model, cache, kv_budget_bytes: int, expected_request_tokens: int | None = None):
    """Switch ``model``'s continuous batching to INT2 pages (hf_kvint2.serving); ``expected_request_tokens`` None:
    the engine's default. Returns the engine's layout (:class:`hf_kvint2.serving.PagedLayout`)."""
    try:
        from .serving import enable_paged_int2
    except ImportError as error:
        raise ImportError(f"The INT2 engine (hf_kvint2.serving) cannot be imported ({error}); serve the stock engine "
                          "with method 'none' (--method none).") from error
    options = {} if expected_request_tokens is None else {"expected_request_tokens": expected_request_tokens}
    return enable_paged_int2(model, cache, kv_budget_bytes=kv_budget_bytes, **options)


def keep_batching_manager(model) -> None:
    """Keep the manager ``model.init_continuous_batching`` returns on the model, for :func:`kv_cache_state`."""
    init = model.init_continuous_batching

    def init_and_keep(*args, **kwargs):
        manager = init(*args, **kwargs)
        setattr(model, MANAGER_ATTRIBUTE, manager)
        return manager

    model.init_continuous_batching = init_and_keep


def kv_cache_state(model, processor=None) -> dict:
    """Runs in the model's process: the paged KV cache's capacity and use. ``total_bytes`` (the pages),
    ``free_bytes`` (free sectors and free blocks), ``reusable_bytes`` (blocks no request holds, kept for prefix
    sharing and given back on demand) and per attention type the blocks and pages requests hold; with the INT2
    engine, also its full-precision window slots (``window_slots``, ``free_window_slots``, ``window_bytes``)."""
    manager = getattr(model, MANAGER_ATTRIBUTE, None)
    if manager is None or manager.batch_processor is None:
        raise RuntimeError("The model's continuous batching has not started: no KV cache to report.")
    cache = manager.batch_processor.cache
    groups, reusable = {}, 0
    for name, allocator in cache.cache_allocators.items():
        held = {block for blocks in allocator.block_table.values() for block in blocks}
        reusable += len(allocator.ledger.cached_blocks) * allocator.bytes_per_block
        groups[name] = {"blocks": allocator.num_blocks, "held_blocks": len(held),
                        "held_pages": len(held) * allocator.pages_per_block,
                        "requests": len(allocator.block_table), "tokens_per_page": allocator.tokens_per_page}
    state = {"cache": type(cache).__name__, "total_bytes": cache.num_sectors * cache.bytes_per_sector,
             "free_bytes": int(cache.compute_free_capacity(relative=False)), "reusable_bytes": reusable,
             "attention_types": groups}
    layout = getattr(cache, "layout", None)
    if layout is not None:  # the INT2 engine: each live request also holds one of its full-precision window slots
        state.update(window_slots=layout.window_slots, free_window_slots=cache.free_window_slots,
                     window_bytes=layout.window_slots * layout.window_bytes)
    return state


def build_app(served: ServedModel, cb_config=None, max_model_len: int | None = None):
    """``(app, model_manager)``: transformers' serving app over ``served``, its model's process started and loaded
    (continuous batching warmed up), plus ``GET /v1/kv_cache``."""
    check_transformers()
    from fastapi.responses import JSONResponse
    from transformers.cli.serving.chat_completion import ChatCompletionHandler
    from transformers.cli.serving.completion import CompletionHandler
    from transformers.cli.serving.model_manager import ModelManager
    from transformers.cli.serving.response import ResponseHandler
    from transformers.cli.serving.server import build_server
    from transformers.cli.serving.systemone import SystemOneHandler
    from transformers.cli.serving.transcription import TranscriptionHandler
    from transformers.cli.serving.utils import GenerationState

    state = GenerationState(continuous_batching=True, cb_config=cb_config or served.continuous_batching_config(),
                            max_model_len=max_model_len)
    # model_timeout=-1: the one model is never unloaded for being idle
    manager = ModelManager(served, state, model_timeout=-1, force_model=served.model_id)
    shared = {"model_manager": manager, "generation_state": state}
    app = build_server(manager, ChatCompletionHandler(**shared), completion_handler=CompletionHandler(**shared),
                       response_handler=ResponseHandler(**shared),
                       transcription_handler=TranscriptionHandler(manager),
                       systemone_handler=SystemOneHandler(**shared))

    @app.get("/v1/kv_cache")
    async def kv_cache():
        return JSONResponse(await manager.get_engine(None).submit(kv_cache_state))

    return app, manager


def _uvicorn_server(app, manager, host: str, port: int, log_level: str):
    import uvicorn

    async def stop_if_the_engine_died() -> None:
        if manager.is_dead:
            server.should_exit = True

    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, callback_notify=stop_if_the_engine_died,
                            timeout_notify=5)
    server = uvicorn.Server(config)
    return server


@contextlib.contextmanager
def running_server(served: ServedModel, host: str = "127.0.0.1", port: int = 0, cb_config=None,
                   max_model_len: int | None = None, log_level: str = "warning"):
    """Serve ``served`` on a thread of this process while the ``with`` block runs; yields the base URL
    (``http://host:port``, the port the system chose for ``port=0``). The model runs in its own process, stopped
    on exit."""
    app, manager = build_app(served, cb_config, max_model_len)
    server = _uvicorn_server(app, manager, host, port, log_level)
    thread = threading.Thread(target=server.run, name="hf_kvint2-serve", daemon=True)
    try:
        thread.start()
        while not server.started:
            if not thread.is_alive():
                raise RuntimeError(f"The server did not start on {host}:{port} (see the error above).")
            thread.join(0.05)
        bound = server.servers[0].sockets[0].getsockname()
        yield f"http://{bound[0]}:{bound[1]}"
    finally:
        server.should_exit = True
        thread.join(30)
        processes = [engine.managed_process for engine in manager.engines.values() if engine.managed_process]
        manager.shutdown()
        for process in processes:  # stopped by shutdown: wait for it, so that nothing outlives the block
            process.join(30)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m hf_kvint2.serve",
        description="An OpenAI-compatible server (POST /v1/chat/completions, /v1/completions, /v1/responses; "
                    "GET /v1/models, /health, /v1/kv_cache) for the bundled SmolLM2-135M-Instruct on transformers' "
                    "continuous batching, its KV cache in INT2 pages.")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT})")
    parser.add_argument("--kv-budget", default="512MiB",
                        help="the KV cache's memory: bytes, or with a unit (512MiB, 1GiB; default 512MiB)")
    parser.add_argument("--method", choices=METHODS, default="oscar",
                        help="oscar: INT2 pages with the calibration shipped for SmolLM2 (default); oscar-scaled: "
                             "INT2 pages, OscarScaledCache (no calibration); none: transformers' stock paged cache")
    parser.add_argument("--max-batch-tokens", type=int, default=None,
                        help="most tokens in one forward of the batch (default: the INT2 engine's, sized from the "
                             "budget; transformers' with --method none)")
    parser.add_argument("--expected-request-tokens", type=int, default=None,
                        help="tokens (prompt and generated) of a typical request: the INT2 engine sizes its "
                             "full-precision window slots for as many such requests as the budget holds (default: "
                             "the engine's)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                        help="the model's dtype (default float32: bfloat16 matmuls are slow on most CPUs)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads of the model's process (default: torch's, one per core)")
    parser.add_argument("--log-level", default="info", help="uvicorn's and the server's log level (default info)")
    args = parser.parse_args(argv)
    try:
        args.kv_budget = parse_bytes(args.kv_budget)
    except ValueError as error:
        parser.error(f"--kv-budget: {error}")
    if args.kv_budget <= 0 or args.port < 0 or (args.threads is not None and args.threads < 1) or \
            (args.expected_request_tokens is not None and args.expected_request_tokens < 1):
        parser.error("--kv-budget must be positive, --port >= 0, --threads >= 1 and --expected-request-tokens >= 1")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    check_transformers()
    from transformers.cli.serving.utils import set_serve_log_level
    from transformers.utils import logging

    set_serve_log_level(logging.log_levels[args.log_level.lower()])
    served = ServedModel.bundled_smollm2(args.dtype, method=args.method, kv_budget_bytes=args.kv_budget,
                                         num_threads=args.threads,
                                         expected_request_tokens=args.expected_request_tokens)
    print(f"Loading {served.model_id} ({args.method}, KV budget {args.kv_budget / 2**20:.0f} MiB) ...",
          file=sys.stderr)
    app, manager = build_app(served, served.continuous_batching_config(max_batch_tokens=args.max_batch_tokens))
    try:
        _uvicorn_server(app, manager, args.host, args.port, args.log_level.lower()).run()
    finally:
        manager.shutdown()
    if manager.is_dead:
        raise SystemExit("The engine died (see the error above): the server stopped.")


if __name__ == "__main__":
    # From the imported module, so that what is pickled for the model's process names hf_kvint2.serve, not __main__
    from hf_kvint2.serve import main as _main

    _main()
