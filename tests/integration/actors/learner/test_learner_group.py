"""A learner group of two ranks (real Ray actors, FSDP2 over gloo) trains as one learner does.

Each step is given to both: the two ranks split its groups, sum their gradients and take the same
optimizer step as a single in-process learner on the whole batch."""

from __future__ import annotations

import pytest
import ray
import torch
from preforked import forkserver_context  # tests/preforked.py

from rlpost.actors.learner import Learner, LearnerSettings, start_learner_group
from rlpost.config import JobConfig
from rlpost.data.samples import Group, Sample
from rlpost.envs.arithmetic import ARITHMETIC_SYSTEM_PROMPT

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

REPLIES = ["<answer>7</answer><|im_end|>", "<answer>5</answer><|im_end|>", "<answer>", "<answer>12</answer> ok"]


def settings(model_path) -> LearnerSettings:
    raw = {
        # chunked scoring and packing (the defaults) on both sides: the group's ranks read the
        # LM head's weight gathered by the root's forward
        "model": {"name_or_path": str(model_path)},
        "rollout": {"temperature": 0.9},
        "optimizer": {"lr": 1e-3},
        # a budget that splits rank 0's share into more micro-batches than rank 1's
        "trainer": {"max_tokens_per_microbatch": 200},
    }
    return LearnerSettings.from_job(JobConfig.model_validate(raw))


def make_groups(learner: Learner, tokenizer, num_groups: int, seed: int) -> list[Group]:
    """``num_groups`` groups of 4 replies of unequal lengths, with behaviour log-probs a little
    off the learner's own (so ratios and clipping play a part)."""
    gen = torch.Generator().manual_seed(seed)
    groups = []
    for g in range(num_groups):
        messages = [
            {"role": "system", "content": ARITHMETIC_SYSTEM_PROMPT},
            {"role": "user", "content": f"What is {g} + {seed}?"},
        ]
        prompt = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"])
        replies = [tokenizer.encode(REPLIES[(g + i) % 4], add_special_tokens=False) for i in range(4)]
        scores = learner.score([prompt + r for r in replies])
        samples, rewards = [], torch.rand(4, generator=gen).round().tolist()
        for reply, reward, score in zip(replies, rewards, scores):
            noise = (0.2 * torch.randn(len(reply), generator=gen)).tolist()
            samples.append(
                Sample(
                    prompt_id=g,
                    token_ids=prompt + reply,
                    logprobs=[0.0] * len(prompt) + [s + n for s, n in zip(score[len(prompt) :], noise)],
                    loss_mask=[False] * len(prompt) + [True] * len(reply),
                    prompt_len=len(prompt),
                    reward=reward,
                    policy_version=learner.version,
                    finished=True,
                )  # fmt: skip
            )
        r = torch.tensor(rewards)
        groups.append(Group(prompt_id=g, samples=samples, advantages=((r - r.mean()) / (r.std() + 1e-4)).tolist(),
                            policy_version=learner.version))  # fmt: skip
    return groups


def test_two_sharded_ranks_take_the_same_steps_as_one_learner(ray_cluster, tiny_model_path, tiny_tokenizer):
    cfg = settings(tiny_model_path)
    one = Learner(cfg)
    initial = {n: p.detach().clone() for n, p in one.model.named_parameters()}
    # 3 groups (rank 0 takes 2, rank 1 one), 3 again, then 1 (rank 1 has nothing: it joins the
    # collectives with passes that add no gradient)
    steps = [make_groups(one, tiny_tokenizer, n, seed) for seed, n in enumerate([3, 3, 1])]
    group = start_learner_group(cfg, 2, timeout_s=120, options_for=lambda rank: {"num_cpus": 0})
    try:
        assert ray.get([h.policy_version.remote() for h in group], timeout=60) == [0, 0]
        for step, groups in enumerate(steps, start=1):
            ranks = ray.get([h.train_step.remote(groups) for h in group], timeout=300)
            alone = one.train_step(groups)
            for rank, metrics in enumerate(ranks):  # every rank reports the whole step
                assert metrics["loss"] == pytest.approx(alone["loss"], rel=1e-5, abs=1e-7), (step, rank)
                assert metrics["grad_norm"] == pytest.approx(alone["grad_norm"], rel=1e-5), (step, rank)
                assert metrics["clip_fraction"] == pytest.approx(alone["clip_fraction"], abs=1e-6), (step, rank)
                assert metrics["num_samples"] == alone["num_samples"] and metrics["policy_version"] == step
            if step == 1:
                # ratios matter, and the norm is clipped (grad_clip 1): the shards' global norm sets the scale
                assert alone["clip_fraction"] > 0 and alone["grad_norm"] > 1
            if step == 3:
                assert ranks[0]["micro_batches"] == alone["micro_batches"]  # rank 1 matched rank 0's passes
        weights = ray.get([h.full_state_dict.remote() for h in group], timeout=120)
        moved = 0.0
        for name, param in one.model.named_parameters():
            for rank in range(2):
                gap = float((weights[rank][name] - param.detach()).abs().max())
                assert gap <= 3e-5, (name, rank, gap)
            moved = max(moved, float((param.detach() - initial[name]).abs().max()))
        # measured: the ranks' weights are within 4.6e-6 (one 2-core machine) to 1.2e-5 (another:
        # the shards' sums add in another order, and AdamW's first steps divide tiny gradients by
        # their own size) of the single learner's, after weights moved by up to 3e-3 (lr 1e-3)
        assert moved > 1e-3
        # scoring is a collective too: both ranks score as the single learner does
        probe = steps[0][0].samples[0].token_ids
        scored = ray.get([h.score.remote([probe]) for h in group], timeout=60)
        for rank in range(2):
            # log-probs near -11 carry the weights' 1e-6 relative differences (measured 1.1e-5 apart)
            assert scored[rank][0] == pytest.approx(one.score([probe])[0], rel=5e-6, abs=1e-5)
    finally:
        ray.get([h.close.remote() for h in group], timeout=60)
        for handle in group:
            ray.kill(handle, no_restart=True)


def test_group_checkpoints_resume_with_one_rank_and_single_checkpoints_with_two(ray_cluster, tiny_model_path,
                                                                                  tiny_tokenizer, tmp_path):  # fmt: skip
    from transformers import AutoModelForCausalLM

    cfg = settings(tiny_model_path)
    single = Learner(cfg)
    steps = [make_groups(single, tiny_tokenizer, n, seed) for seed, n in enumerate([3, 2, 3, 2])]
    group = start_learner_group(cfg, 2, timeout_s=120, options_for=lambda rank: {"num_cpus": 0})

    def group_step(groups):
        return ray.get([h.train_step.remote(groups) for h in group], timeout=300)[0]

    try:
        for groups in steps[:2]:
            group_step(groups)
        saved = ray.get([h.save_checkpoint.remote(str(tmp_path / "a"), 2, {"pools": [7]}) for h in group], timeout=300)
        assert saved[0] == saved[1] == tmp_path / "a" / "checkpoints" / "step_2"
        after_3 = group_step(steps[2])
        weights_3 = ray.get([h.full_state_dict.remote() for h in group], timeout=120)[0]

        # two ranks -> one: the single learner continues exactly as the group did
        info = single.load_checkpoint(saved[0])
        assert (info["step"], info["version"], info["rollout_state"]) == (2, 2, {"pools": [7]})
        # the consolidated model is a plain Hugging Face checkpoint of the same weights
        exported = AutoModelForCausalLM.from_pretrained(saved[0], dtype=torch.float32)
        assert exported.config.architectures == [type(exported).__name__]
        for name, param in exported.state_dict().items():
            assert torch.equal(param, single.model.state_dict()[name]), name
        alone_3 = single.train_step(steps[2])
        assert alone_3["loss"] == pytest.approx(after_3["loss"], rel=1e-5, abs=1e-7)
        for name, param in single.model.named_parameters():
            assert torch.allclose(weights_3[name], param.detach(), atol=1e-5, rtol=0), name

        # one rank -> two: a single learner's checkpoint spread over the group's shards
        path = single.save_checkpoint(tmp_path / "b", 3)
        loaded = ray.get([h.load_checkpoint.remote(str(path)) for h in group], timeout=300)
        assert [(i["step"], i["version"]) for i in loaded] == [(3, 3), (3, 3)]
        after_4, alone_4 = group_step(steps[3]), single.train_step(steps[3])
        assert after_4["loss"] == pytest.approx(alone_4["loss"], rel=1e-5, abs=1e-7)
        assert after_4["grad_norm"] == pytest.approx(alone_4["grad_norm"], rel=1e-5)
        weights_4 = ray.get([h.full_state_dict.remote() for h in group], timeout=120)[0]
        for name, param in single.model.named_parameters():  # the AdamW moments came along
            assert torch.allclose(weights_4[name], param.detach(), atol=1e-5, rtol=0), name

        # two ranks -> two: the group's own checkpoint takes it back to step 2
        ray.get([h.load_checkpoint.remote(saved[0]) for h in group], timeout=300)
        assert group_step(steps[2])["loss"] == pytest.approx(after_3["loss"], rel=1e-6, abs=1e-8)
    finally:
        ray.get([h.close.remote() for h in group], timeout=60)
        for handle in group:
            ray.kill(handle, no_restart=True)


def rank_context():
    """The 2-rank tests' processes fork from a server that imported the learner (torch,
    transformers): ~5 s saved per rank over a spawned process on 2 cores."""
    return forkserver_context("rlpost.actors.learner", "rlpost.actors.sharding")


class FailingPublisher:
    """Takes two tensors of a publish, then fails as a dead bus peer would."""

    device = "cpu"

    def publish(self, named_tensors, version):
        from rlpost.transport import WeightSyncError

        stream = iter(named_tensors)
        next(stream), next(stream)
        raise WeightSyncError("a peer died", version=version)


def publish_then_score(rank, model_path, port, probe, results):
    """One rank of a 2-rank group (a process of its own): a publish that fails on rank 0 after two
    tensors, then a score, which only comes out right if both ranks are at the same collective."""
    from rlpost.actors import sharding

    sharding.join_group(sharding.GroupSpec("127.0.0.1", port, 2, "gloo", 60.0), rank)
    learner = Learner(settings(model_path), sharded=True, publisher=FailingPublisher())
    try:
        learner.publish()
        outcome = "published"
    except Exception as err:
        outcome = type(err).__name__
    results.put((rank, outcome, learner.score([probe])[0]))
    sharding.leave_group()


def test_a_publish_that_fails_on_rank_0_leaves_the_group_in_step(tiny_model_path):
    probe = list(range(3, 40))
    store = torch.distributed.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False)
    ctx = rank_context()
    results = ctx.Queue()
    procs = [ctx.Process(target=publish_then_score, args=(r, str(tiny_model_path), store.port, probe, results))
             for r in range(2)]  # fmt: skip
    for proc in procs:
        proc.start()
    got = dict((rank, (outcome, scores)) for rank, outcome, scores in (results.get(timeout=240) for _ in procs))
    for proc in procs:
        proc.join(60)
    assert got[0][0] == "WeightSyncError" and got[1][0] == "published"  # rank 1 gathered every tensor
    expected = Learner(settings(tiny_model_path)).score([probe])[0]
    for rank in range(2):
        assert got[rank][1] == pytest.approx(expected, abs=1e-5), rank


def load_then_report(rank, model_path, reference_path, port, results):
    """One rank of a 2-rank group (a process of its own): load the sharded model; report how, the
    bytes of its local shards and (rank 0) the names whose gathered weights differ from
    ``reference_path``'s model."""
    from transformers import AutoModelForCausalLM

    from rlpost.actors import sharding

    sharding.join_group(sharding.GroupSpec("127.0.0.1", port, 2, "gloo", 60.0), rank)
    model = sharding.empty_model(model_path)
    sharding.shard_model(model)
    how = sharding.load_shards(model, model_path, torch.device("cpu"))
    whole = {name: sharding.full_tensor(t.detach()) for name, t in model.state_dict().items()}
    differ = None
    if rank == 0:
        reference = AutoModelForCausalLM.from_pretrained(reference_path, dtype=torch.float32).state_dict()
        differ = sorted(set(reference) ^ set(whole)) + [k for k, v in reference.items() if k in whole
                                                         and not torch.equal(whole[k], v)]  # fmt: skip
    results.put((rank, how, sharding.local_state_bytes(model), differ))
    sharding.leave_group()


@pytest.mark.parametrize("layout", ["safetensors", "pytorch_model.bin"])
def test_ranks_fill_their_shards_from_rank_0_or_load_the_model_whole(tiny_model_path, tmp_path, layout):
    """From safetensors, rank 0 reads one tensor at a time and every rank keeps its shard (no rank
    holds the whole model); other checkpoints are loaded whole, then sharded. Either way the
    gathered weights are the checkpoint's, bit for bit, and each rank holds half of them."""
    import shutil

    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).state_dict()
    path = tiny_model_path
    if layout == "pytorch_model.bin":
        path = tmp_path / "bin"
        shutil.copytree(tiny_model_path, path, ignore=shutil.ignore_patterns("*.safetensors"))
        torch.save({k: v for k, v in reference.items() if k != "lm_head.weight"}, path / "pytorch_model.bin")
    store = torch.distributed.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False)
    ctx = rank_context()
    results = ctx.Queue()
    procs = [ctx.Process(target=load_then_report, args=(r, str(path), str(tiny_model_path), store.port, results))
             for r in range(2)]  # fmt: skip
    for proc in procs:
        proc.start()
    got = {rank: (how, held, differ) for rank, how, held, differ in (results.get(timeout=240) for _ in procs)}
    for proc in procs:
        proc.join(60)
    assert got[0][0] == got[1][0] == ("streamed" if layout == "safetensors" else "whole")
    assert got[0][2] == []  # every weight, bit for bit
    total = sum(v.numel() * 4 for k, v in reference.items() if k != "lm_head.weight")  # tied: stored once
    assert all(abs(got[r][1] - total / 2) < 0.01 * total for r in range(2)), (got[0][1], got[1][1], total)
