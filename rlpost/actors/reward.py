"""The ``reward`` actor: a learned reward model or an LLM judge, scoring each episode's final response.

One shared actor (with a ``reward_model`` section), called with the [user prompt, final response]
rows and reference answers by every env pool's :class:`~rlpost.envs.reward_model.RewardModelReward`
when episodes end; the env pool sets ``reward = rule_weight * rule + weight * score``. A classifier
renders each conversation with its own chat template, truncated to its last ``max_length`` tokens
(one scalar each); a judge fills its template, generates greedily on its own vLLM engine and
scores ``verdict / scale``: a reply without a readable verdict scores 0 and is counted as
``unparsed_verdict`` (logged once). The actor is stateless (the model is frozen): the supervisor
restarts a dead one, and an env pool's call waits for it (``reward_model.restart_wait_s``).
"""

from __future__ import annotations

import logging
import re
import string
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from rlpost.actors import REWARD_ACTOR, start_actor
from rlpost.config import RewardModelConfig, TorchRoleResources
from rlpost.runtime.liveness import progress, working

if TYPE_CHECKING:
    from rlpost.config import JobConfig

logger = logging.getLogger(__name__)

UNPARSED = "unparsed_verdict"  # the error kind of a judge reply without a readable verdict


@dataclass(frozen=True)
class RewardSettings:
    """The job config sections the reward actor reads (the YAML's sections of the same names)."""

    reward_model: RewardModelConfig
    resources: TorchRoleResources  # ``resources.reward``
    run_name: str = ""  # the run whose metrics the actor reports under

    @classmethod
    def from_job(cls, cfg: JobConfig) -> RewardSettings:
        if cfg.reward_model is None:
            raise ValueError("the job config has no reward_model section")
        return cls(cfg.reward_model, cfg.resources.reward, cfg.logging.run_name or "")


@dataclass
class Scores:
    """What one scoring call returns: a score per conversation and the failures by kind."""

    scores: list[float]
    errors: dict[str, int]


class RewardModel:
    """The plain class behind the ``reward`` actor (usable in-process: ``rlpost eval``, tests).
    ``engine`` (a judge's only): a :class:`~rlpost.policies.VLLMEngineClient` to judge with instead
    of starting one. ValueError when the model cannot serve its kind (a classifier with several
    labels; a judge template without ``{completion}``)."""

    def __init__(self, cfg: RewardModelConfig, *, engine: Any = None) -> None:
        from transformers import AutoTokenizer

        self.cfg = cfg
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.name_or_path)
        self.tokenizer.truncation_side = "left"  # a long conversation keeps its response
        self._worker = None
        self.num_scored = 0
        self._logged: set[str] = set()
        if cfg.kind == "classifier":
            self._load_classifier()
        else:
            self.template = judge_template(cfg.judge.template)
            self.engine = engine if engine is not None else self._start_engine()

    # ------------------------------------------------------------------ scoring

    def score(self, conversations: list[list[dict[str, str]]], answers: list[str | None] | None = None) -> Scores:
        """Score each conversation (``[user prompt, final response]`` messages); ``answers``:
        each row's reference answer, for a judge template that shows it."""
        answers = answers if answers is not None else [None] * len(conversations)
        if len(answers) != len(conversations):
            raise ValueError(f"{len(conversations)} conversations but {len(answers)} answers")
        if not conversations:
            return Scores([], {})
        with working("score"):
            if self.cfg.kind == "classifier":
                result = Scores(self._classify(conversations), {})
            else:
                result = self._judge(conversations, answers)
        self.num_scored += len(conversations)
        return result

    def _load_classifier(self) -> None:
        from transformers import AutoModelForSequenceClassification

        from rlpost.policies.trl_interop import HFRewardModelWrapper

        dtype = getattr(torch, self.cfg.dtype or "float32") if torch.cuda.is_available() else torch.float32
        model = AutoModelForSequenceClassification.from_pretrained(self.cfg.name_or_path, dtype=dtype)
        if model.config.num_labels != 1:
            raise ValueError(
                f"reward_model.name_or_path {self.cfg.name_or_path!r} has {model.config.num_labels} labels; a reward "
                "model has one (a scalar score)"
            )
        if model.config.pad_token_id is None:  # it finds each row's last token by the pad id
            model.config.pad_token_id = self._pad_id()
        device = "cuda" if torch.cuda.is_available() else "cpu"
        self.model = model.to(device).eval().requires_grad_(False)
        self.scorer = HFRewardModelWrapper(
            self.model, token_key="input_ids", attention_mask_key="attention_mask", inference_mode=True
        )

    def _pad_id(self) -> int:
        pad = self.tokenizer.pad_token_id
        return int(pad if pad is not None else self.tokenizer.eos_token_id)

    def _classify(self, conversations: list[list[dict[str, str]]]) -> list[float]:
        from tensordict import TensorDict

        texts = [self._render(messages) for messages in conversations]
        scores: list[float] = []
        for start in range(0, len(texts), self.cfg.batch_size):
            chunk = texts[start : start + self.cfg.batch_size]
            encoded = self.tokenizer(chunk, return_tensors="pt", padding=True, truncation=True,
                                     max_length=self.cfg.max_length, add_special_tokens=False)  # fmt: skip
            device = self.model.device
            batch = TensorDict({k: encoded[k].to(device) for k in ("input_ids", "attention_mask")}, [len(chunk)])
            scores += self.scorer(batch).get("reward").float().cpu().tolist()
            progress()
        return scores

    def _render(self, messages: list[dict[str, str]]) -> str:
        if getattr(self.tokenizer, "chat_template", None):
            return self.tokenizer.apply_chat_template(messages, tokenize=False)
        return "\n\n".join(m["content"] for m in messages)  # a model without a chat template

    def _start_engine(self) -> Any:
        from rlpost.actors.vllm_workers import make_vllm_worker

        self._worker = make_vllm_worker(self.cfg.name_or_path, make_ray_worker=False, engine_config=self.cfg.engine,
                                        dtype=self.cfg.dtype or "auto")  # fmt: skip
        return self._worker.client

    def _judge(self, conversations: list[list[dict[str, str]]], answers: list[str | None]) -> Scores:
        judge = self.cfg.judge
        prompts = []
        for messages, answer in zip(conversations, answers):
            text = self.template.format(
                prompt=messages[0]["content"] if messages else "",
                completion=messages[-1]["content"] if messages else "",
                answer="" if answer is None else answer,
            )
            messages = [{"role": "user", "content": text}]
            if judge.system_prompt:
                messages.insert(0, {"role": "system", "content": judge.system_prompt})
            ids = self.tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                                     return_dict=True)["input_ids"]  # fmt: skip
            prompts.append(list(ids)[-(self.cfg.engine.max_model_len - judge.max_tokens) :])
        sampling = {"temperature": 0.0, "max_tokens": judge.max_tokens, "logprobs": False}
        replies = [self.tokenizer.decode(c[0].token_ids, skip_special_tokens=True)
                   for c in self.engine.generate(prompts, sampling)]  # fmt: skip
        scores, errors = [], Counter()
        for reply in replies:
            verdict = parse_verdict(reply, judge.pattern, judge.verdicts)
            if verdict is None:
                errors[UNPARSED] += 1
                if UNPARSED not in self._logged:
                    self._logged.add(UNPARSED)
                    logger.warning("the judge's reply has no verdict matching %r; scored 0 (counted in "
                                   "reward_errors as %s; logged once): %r", judge.pattern, UNPARSED, reply[:500])  # fmt: skip
                scores.append(0.0)
            else:
                scores.append(verdict / judge.scale)
        return Scores(scores, dict(errors))

    def shutdown(self) -> None:
        """Stop the judge's engine (when this class started it)."""
        if self._worker is not None:
            self._worker.shutdown()
            self._worker = None


def judge_template(template: str) -> str:
    """The judge's template: ``template`` itself, or the text of the file it names. It must show
    the judge the response (``{completion}``) and may name only ``{prompt}``, ``{completion}`` and
    ``{answer}``."""
    if "{" not in template and Path(template).is_file():
        template = Path(template).read_text()
    fields = {name for _, name, _, _ in string.Formatter().parse(template) if name is not None}
    unknown = fields - {"prompt", "completion", "answer"}
    if unknown or "completion" not in fields:
        raise ValueError(
            f"reward_model.judge.template names {sorted(fields)}: it must contain {{completion}} and may use only "
            "{prompt}, {completion} and {answer} (double a brace to write one: {{ }})"
        )
    return template


def parse_verdict(reply: str, pattern: str, verdicts: dict[str, float] | None) -> float | None:
    """The verdict in a judge's ``reply``: the first group of the last match of ``pattern``, read
    as a number, or looked up (without case) in ``verdicts``; None when there is none."""
    matches = list(re.finditer(pattern, reply))
    if not matches:
        return None
    text = (matches[-1].group(1) or "").strip()
    if verdicts is not None:
        table = {key.lower(): value for key, value in verdicts.items()}
        return table.get(text.lower())
    try:
        value = float(text)
    except ValueError:
        return None
    return value if value == value and abs(value) != float("inf") else None


class RewardActor(RewardModel):
    """The Ray actor ``reward``: the plain class, one call at a time, reporting metrics."""

    def __init__(self, settings: RewardSettings):
        from rlpost.actors.learner import set_torch_threads
        from rlpost.record.metrics import RoleMetrics

        set_torch_threads(settings.resources.num_threads)
        super().__init__(settings.reward_model)
        self.metrics = RoleMetrics("reward", settings.run_name, REWARD_ACTOR)

    def score(self, conversations: list[list[dict[str, str]]], answers: list[str | None] | None = None) -> Scores:
        result = super().score(conversations, answers)
        self.metrics.record(samples_scored=len(result.scores), unparsed_verdicts=result.errors.get(UNPARSED, 0))
        return result


def start_reward(settings: RewardSettings, *, name: str = REWARD_ACTOR, namespace: str | None = None, **options):
    """Start the named reward actor (``options`` go to ``.options()``)."""
    return start_actor(RewardActor, settings, name=name, resources=settings.resources, namespace=namespace, **options)
