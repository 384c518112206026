"""Checks of a job before any actor starts: what would otherwise kill an actor later, or a run
part-way, is a :class:`~rlpost.config.ConfigError` that names the key (``rlpost train`` exits 2).

:func:`check_job` runs them all: the tools' sandbox, a custom loss's import, and the training
data against the model and the engine.
"""

from __future__ import annotations

import logging
import time

from rlpost.config import JobConfig

log = logging.getLogger("rlpost")


def check_job(cfg: JobConfig) -> None:
    """Every check below, in the order a user would fix them."""
    check_tools(cfg)
    check_custom_loss(cfg)
    check_data(cfg)


def check_data(cfg: JobConfig) -> None:
    """The training data against the model and the engine: the pools' env is built here (a missing
    column, a bad reward path or a template the tokenizer cannot render is a ConfigError now, not
    an env pool's death later), and every prompt is measured against ``rollout.engine.max_model_len``
    less ``rollout.max_tokens`` (:func:`rlpost.envs.tasks.fit_prompts`)."""
    from rlpost.actors.env_pool import load_tokenizer, with_chat_template
    from rlpost.envs.tasks import fit_prompts, make_env

    start = time.perf_counter()
    tokenizer = with_chat_template(load_tokenizer(cfg), cfg)
    check_model_fits(cfg, tokenizer)
    env = make_env(cfg, tokenizer, 1, input_mode="tokens")
    fit = fit_prompts(env, cfg)
    if fit is not None:
        log.info("data: %d prompts checked against the engine in %.1f s (the longest %d tokens, %d leave room for "
                 "rollout.max_tokens=%d)", len(fit.kept) + len(fit.too_long), time.perf_counter() - start,
                 fit.longest, len(fit.kept), cfg.rollout.max_tokens)  # fmt: skip


def check_model_fits(cfg: JobConfig, tokenizer) -> None:
    """ConfigError for what an engine would refuse or a learner index out of range: the engine's
    length beyond the model's context, a tokenizer (of another model) beyond its embeddings."""
    from transformers import AutoConfig

    from rlpost.config import ConfigError

    model = AutoConfig.from_pretrained(cfg.model.name_or_path, trust_remote_code=cfg.model.trust_remote_code)
    model = getattr(model, "text_config", model)  # a multimodal config keeps its language model's here
    context = getattr(model, "max_position_embeddings", None)
    if context is not None and cfg.rollout.engine.max_model_len > context:
        raise ConfigError(
            f"rollout.engine.max_model_len={cfg.rollout.engine.max_model_len} is beyond the context of "
            f"model.name_or_path={cfg.model.name_or_path!r} ({context} positions, max_position_embeddings)"
        )
    vocab = getattr(model, "vocab_size", None)
    if vocab is not None and len(tokenizer) > vocab:
        raise ConfigError(
            f"the tokenizer ({cfg.model.tokenizer_path!r}) has {len(tokenizer)} tokens, more than the "
            f"{vocab} rows of the embeddings of model.name_or_path={cfg.model.name_or_path!r}: model.tokenizer "
            "must be the model's own (or one of its family)"
        )


def check_custom_loss(cfg: JobConfig) -> None:
    """A ``loss.custom_fn`` that cannot be imported here is a ConfigError (the learner imports it
    again in its own process)."""
    from rlpost.algo import load_loss_function
    from rlpost.config import ConfigError

    if cfg.loss.custom_fn:
        try:
            load_loss_function(cfg.loss.custom_fn)
        except ValueError as exc:
            raise ConfigError(f"loss.custom_fn: {exc}") from None


def check_tools(cfg: JobConfig) -> None:
    """Log what guards the tools' code; ConfigError when the namespace sandbox is asked for and
    cannot run here (each env pool checks again on its own node)."""
    from rlpost.config import ConfigError
    from rlpost.envs.sandbox import SandboxUnavailable, check_sandbox

    tools = cfg.tools
    if not tools.enabled:
        return
    names = (["python"] if tools.python.enabled else []) + list(tools.functions)
    log.info("tools: %s; model-written code runs in sandbox %s", ", ".join(names), tools.sandbox)
    if not tools.python.enabled:
        return
    if tools.sandbox == "guard":
        log.warning("tools.sandbox=guard: the in-process guard and rlimits only, NOT a security boundary")
        return
    try:
        check_sandbox(tools.sandbox)
    except SandboxUnavailable as exc:
        raise ConfigError(f"tools.sandbox={tools.sandbox}: {exc}") from None
