"""CleanRL's single-file agents (vwxyzjn/cleanrl), their update code as written, through
``functacc.jit`` against eager.

CleanRL writes each agent as one script: the update reads and writes the script's globals.
The code below is theirs, the networks smaller, the environment replaced by random batches
(no gym here). Each script runs in a namespace of its own, as ``python sac.py`` would, once
eager and once with its update jitted (``backend="eager"``: compared bit for bit).

Before (5145621): SAC's ``a_optimizer = optim.Adam([log_alpha])`` over a bare tensor was a
``ValueError`` ("not a parameter of the step's modules"); its update logging through a
writer method that appends to a script list left the trace's symbols there, silently; and
PPO's minibatch update, reading ``b_obs`` and the other batch globals that the script
assigns after ``jit()``, each iteration, was a ``TraceError``.
"""

from __future__ import annotations

import collections
import types

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import functacc

# cleanrl/sac_continuous_action.py: the networks, then the training part of the loop body
# (`if global_step > args.learning_starts:`) as the update function, `rb.sample()`'s batch
# its arguments. `writer` is a stand-in for TensorBoard's (a method appending to a list).
SAC = """
LOG_STD_MAX = 2
LOG_STD_MIN = -5


class SoftQNetwork(nn.Module):
    def __init__(self, obs, act):
        super().__init__()
        self.fc1 = nn.Linear(obs + act, 32)
        self.fc2 = nn.Linear(32, 32)
        self.fc3 = nn.Linear(32, 1)

    def forward(self, x, a):
        x = torch.cat([x, a], 1)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        x = self.fc3(x)
        return x


class Actor(nn.Module):
    def __init__(self, obs, act):
        super().__init__()
        self.fc1 = nn.Linear(obs, 32)
        self.fc2 = nn.Linear(32, 32)
        self.fc_mean = nn.Linear(32, act)
        self.fc_logstd = nn.Linear(32, act)
        self.register_buffer("action_scale", torch.full((act,), 2.0))
        self.register_buffer("action_bias", torch.zeros(act))

    def forward(self, x):
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        mean = self.fc_mean(x)
        log_std = self.fc_logstd(x)
        log_std = torch.tanh(log_std)
        log_std = LOG_STD_MIN + 0.5 * (LOG_STD_MAX - LOG_STD_MIN) * (log_std + 1)
        return mean, log_std

    def get_action(self, x):
        mean, log_std = self(x)
        std = log_std.exp()
        normal = torch.distributions.Normal(mean, std)
        x_t = normal.rsample()
        y_t = torch.tanh(x_t)
        action = y_t * self.action_scale + self.action_bias
        log_prob = normal.log_prob(x_t)
        log_prob -= torch.log(self.action_scale * (1 - y_t.pow(2)) + 1e-6)
        log_prob = log_prob.sum(1, keepdim=True)
        mean = torch.tanh(mean) * self.action_scale + self.action_bias
        return action, log_prob, mean


class Writer:
    def add_scalar(self, tag, value, step):
        logged.append((tag, value, step))


torch.manual_seed(0)
actor = Actor(3, 2)
qf1 = SoftQNetwork(3, 2)
qf2 = SoftQNetwork(3, 2)
qf1_target = SoftQNetwork(3, 2)
qf2_target = SoftQNetwork(3, 2)
qf1_target.load_state_dict(qf1.state_dict())
qf2_target.load_state_dict(qf2.state_dict())
q_optimizer = optim.Adam(list(qf1.parameters()) + list(qf2.parameters()), lr=args.q_lr)
actor_optimizer = optim.Adam(list(actor.parameters()), lr=args.policy_lr)
target_entropy = -2.0
log_alpha = torch.zeros(1, requires_grad=True)
alpha = log_alpha.exp().item()
a_optimizer = optim.Adam([log_alpha], lr=args.q_lr)
writer = Writer()
logged = []


def update(observations, actions, next_observations, rewards, dones, global_step):
    global alpha
    with torch.no_grad():
        next_state_actions, next_state_log_pi, _ = actor.get_action(next_observations)
        qf1_next_target = qf1_target(next_observations, next_state_actions)
        qf2_next_target = qf2_target(next_observations, next_state_actions)
        min_qf_next_target = torch.min(qf1_next_target, qf2_next_target) - alpha * next_state_log_pi
        next_q_value = rewards.flatten() + (1 - dones.flatten()) * args.gamma * (
            min_qf_next_target
        ).view(-1)

    qf1_a_values = qf1(observations, actions).view(-1)
    qf2_a_values = qf2(observations, actions).view(-1)
    qf1_loss = F.mse_loss(qf1_a_values, next_q_value)
    qf2_loss = F.mse_loss(qf2_a_values, next_q_value)
    qf_loss = qf1_loss + qf2_loss

    q_optimizer.zero_grad()
    qf_loss.backward()
    q_optimizer.step()

    if global_step % args.policy_frequency == 0:
        for _ in range(args.policy_frequency):
            pi, log_pi, _ = actor.get_action(observations)
            qf1_pi = qf1(observations, pi)
            qf2_pi = qf2(observations, pi)
            min_qf_pi = torch.min(qf1_pi, qf2_pi)
            actor_loss = ((alpha * log_pi) - min_qf_pi).mean()

            actor_optimizer.zero_grad()
            actor_loss.backward()
            actor_optimizer.step()

            if args.autotune:
                with torch.no_grad():
                    _, log_pi, _ = actor.get_action(observations)
                alpha_loss = (-log_alpha.exp() * (log_pi + target_entropy)).mean()

                a_optimizer.zero_grad()
                alpha_loss.backward()
                a_optimizer.step()
                alpha = log_alpha.exp().item()

    if global_step % args.target_network_frequency == 0:
        for param, target_param in zip(qf1.parameters(), qf1_target.parameters()):
            target_param.data.copy_(args.tau * param.data + (1 - args.tau) * target_param.data)
        for param, target_param in zip(qf2.parameters(), qf2_target.parameters()):
            target_param.data.copy_(args.tau * param.data + (1 - args.tau) * target_param.data)

    if global_step % 4 == 0:
        writer.add_scalar("losses/qf1_values", qf1_a_values.mean().item(), global_step)
        writer.add_scalar("losses/qf_loss", qf_loss.item() / 2.0, global_step)
        writer.add_scalar("losses/actor_loss", actor_loss.item(), global_step)
        writer.add_scalar("losses/alpha", alpha, global_step)
"""

SAC_ARGS = dict(
    q_lr=1e-3, policy_lr=3e-4, gamma=0.99, tau=0.005, policy_frequency=2,
    target_network_frequency=1, autotune=True,
)  # fmt: skip


def script(source: str, **args: object) -> dict:
    """``source`` run as a script of its own: its globals."""
    namespace = {"__name__": "cleanrl_script", "torch": torch, "nn": nn, "F": F, "np": np}
    namespace.update(optim=torch.optim, args=type("Args", (), args))
    exec(compile(source, "<cleanrl script>", "exec"), namespace)
    return namespace


def sac_run(jit: bool) -> tuple[dict, object]:
    g = script(SAC, **SAC_ARGS)
    update = g["update"]
    if jit:
        modules = [g[k] for k in ("actor", "qf1", "qf2", "qf1_target", "qf2_target")]
        opts = [g[k] for k in ("q_optimizer", "actor_optimizer", "a_optimizer")]
        update = functacc.jit(update, modules=modules, optimizers=opts, backend="eager")
    data = torch.Generator().manual_seed(1)
    torch.manual_seed(5)  # the policy's draws
    for global_step in range(1, 9):
        batch = [torch.randn(16, n, generator=data) for n in (3, 2, 3, 1)]
        dones = (torch.rand(16, 1, generator=data) < 0.1).float()
        update(*batch, dones, global_step)
    return g, update


def test_cleanrl_sac_with_its_bare_log_alpha_trains_and_logs_as_in_eager() -> None:
    (eager, _), (jitted, step) = sac_run(False), sac_run(True)
    assert jitted["logged"] == eager["logged"] and len(eager["logged"]) == 8
    assert jitted["alpha"] == eager["alpha"] != 1.0  # the .item() the script keeps
    for k in ("actor", "qf1", "qf2", "qf1_target", "qf2_target"):
        for (n, a), b in zip(jitted[k].named_parameters(), eager[k].parameters(), strict=True):
            assert torch.equal(a, b), (k, n)
            assert type(a.grad) is type(b.grad) and (a.grad is None or torch.equal(a.grad, b.grad))
        for a, b in zip(jitted[k].buffers(), eager[k].buffers(), strict=True):
            assert torch.equal(a, b), k
    for k in ("q_optimizer", "actor_optimizer", "a_optimizer"):
        a, b = jitted[k].state_dict()["state"], eager[k].state_dict()["state"]
        assert a.keys() == b.keys() and all(
            torch.equal(a[i][s], b[i][s]) for i in a for s in a[i]
        ), k
    log_alpha = jitted["log_alpha"]
    assert torch.equal(log_alpha, eager["log_alpha"]) and log_alpha.requires_grad
    assert torch.equal(log_alpha.grad, eager["log_alpha"].grad)
    assert jitted["a_optimizer"].param_groups[0]["params"][0] is log_alpha  # the same tensor
    # Traces: global_step's branches (% 2, % 4) take three variants, and the first call came
    # without gradients.
    assert step.num_traces <= 4, [t.reason for t in step.traces]


# cleanrl/ppo.py: the agent, and the minibatch update of "Optimizing the policy and value
# network" as a function of `mb_inds`; the script's loop assigns `b_obs`, ... and
# `clipfracs = []` each iteration, after the update was jitted.
PPO = """
def layer_init(layer, std=np.sqrt(2), bias_const=0.0):
    torch.nn.init.orthogonal_(layer.weight, std)
    torch.nn.init.constant_(layer.bias, bias_const)
    return layer


class Agent(nn.Module):
    def __init__(self, obs, n):
        super().__init__()
        self.critic = nn.Sequential(
            layer_init(nn.Linear(obs, 64)),
            nn.Tanh(),
            layer_init(nn.Linear(64, 64)),
            nn.Tanh(),
            layer_init(nn.Linear(64, 1), std=1.0),
        )
        self.actor = nn.Sequential(
            layer_init(nn.Linear(obs, 64)),
            nn.Tanh(),
            layer_init(nn.Linear(64, 64)),
            nn.Tanh(),
            layer_init(nn.Linear(64, n), std=0.01),
        )

    def get_value(self, x):
        return self.critic(x)

    def get_action_and_value(self, x, action=None):
        logits = self.actor(x)
        probs = Categorical(logits=logits)
        if action is None:
            action = probs.sample()
        return action, probs.log_prob(action), probs.entropy(), self.critic(x)


torch.manual_seed(0)
agent = Agent(4, 2)
optimizer = optim.Adam(agent.parameters(), lr=args.learning_rate, eps=1e-5)


def minibatch(mb_inds):
    global clipfracs
    _, newlogprob, entropy, newvalue = agent.get_action_and_value(
        b_obs[mb_inds], b_actions.long()[mb_inds]
    )
    logratio = newlogprob - b_logprobs[mb_inds]
    ratio = logratio.exp()

    with torch.no_grad():
        old_approx_kl = (-logratio).mean()
        approx_kl = ((ratio - 1) - logratio).mean()
        clipfracs += [((ratio - 1.0).abs() > args.clip_coef).float().mean().item()]

    mb_advantages = b_advantages[mb_inds]
    if args.norm_adv:
        mb_advantages = (mb_advantages - mb_advantages.mean()) / (mb_advantages.std() + 1e-8)

    pg_loss1 = -mb_advantages * ratio
    pg_loss2 = -mb_advantages * torch.clamp(ratio, 1 - args.clip_coef, 1 + args.clip_coef)
    pg_loss = torch.max(pg_loss1, pg_loss2).mean()

    newvalue = newvalue.view(-1)
    if args.clip_vloss:
        v_loss_unclipped = (newvalue - b_returns[mb_inds]) ** 2
        v_clipped = b_values[mb_inds] + torch.clamp(
            newvalue - b_values[mb_inds],
            -args.clip_coef,
            args.clip_coef,
        )
        v_loss_clipped = (v_clipped - b_returns[mb_inds]) ** 2
        v_loss_max = torch.max(v_loss_unclipped, v_loss_clipped)
        v_loss = 0.5 * v_loss_max.mean()
    else:
        v_loss = 0.5 * ((newvalue - b_returns[mb_inds]) ** 2).mean()

    entropy_loss = entropy.mean()
    loss = pg_loss - args.ent_coef * entropy_loss + v_loss * args.vf_coef

    optimizer.zero_grad()
    loss.backward()
    nn.utils.clip_grad_norm_(agent.parameters(), args.max_grad_norm)
    optimizer.step()
    return approx_kl, old_approx_kl, pg_loss.item(), v_loss.item(), entropy_loss.item()
"""

PPO_ARGS = dict(
    learning_rate=2.5e-4, clip_coef=0.2, norm_adv=True, clip_vloss=True, ent_coef=0.01,
    vf_coef=0.5, max_grad_norm=0.5, batch_size=64, minibatch_size=16, update_epochs=2,
    target_kl=0.7,  # random old log-probs: a large KL; some iterations stop after one epoch
)  # fmt: skip


def ppo_run(jit: bool) -> tuple[list, dict, object]:
    g = script(PPO, **PPO_ARGS)
    g["Categorical"] = torch.distributions.Categorical
    update = g["minibatch"]
    if jit:
        update = functacc.jit(
            g["minibatch"], modules=[g["agent"]], optimizers=[g["optimizer"]], backend="eager"
        )
    args, data = g["args"], torch.Generator().manual_seed(0)
    np.random.seed(0)
    seen = []
    for _ in range(3):  # iterations: a rollout's batch, then the update epochs over it
        for name in ("b_obs", "b_actions", "b_logprobs", "b_advantages", "b_returns", "b_values"):
            shape = (args.batch_size, 4) if name == "b_obs" else (args.batch_size,)
            g[name] = torch.randn(shape, generator=data)
        g["b_actions"] = (g["b_actions"] > 0).float()
        b_inds = np.arange(args.batch_size)
        g["clipfracs"] = []
        for _epoch in range(args.update_epochs):
            np.random.shuffle(b_inds)
            for start in range(0, args.batch_size, args.minibatch_size):
                mb_inds = torch.from_numpy(b_inds[start : start + args.minibatch_size])
                approx_kl, *losses = update(mb_inds)
                seen.append([approx_kl.item(), *losses])
            if args.target_kl is not None and approx_kl > args.target_kl:
                break
        seen.append(list(g["clipfracs"]))
    return seen, g, update


def test_cleanrl_ppo_minibatch_update_reads_the_scripts_batch_globals_as_in_eager() -> None:
    (eager, e, _), (jitted, j, step) = ppo_run(False), ppo_run(True)
    assert jitted == eager
    # clipfracs of each iteration: two epochs of 4 minibatches, or one (the KL stop)
    assert [len(x) for x in eager if len(x) != 5] == [8, 4, 8]
    for a, b in zip(j["agent"].parameters(), e["agent"].parameters(), strict=True):
        assert torch.equal(a, b) and torch.equal(a.grad, b.grad)
    assert step.num_traces == 1, [t.reason for t in step.traces]
    assert j["clipfracs"] == e["clipfracs"] and len(e["clipfracs"]) >= 4


# cleanrl/td3_continuous_action.py and cleanrl/c51.py: the training part of the loop as the
# update, `rb.sample()`'s batch (a NamedTuple, as stable-baselines3's buffer returns) its
# argument; TD3's target policy noise from torch.randn_like, its clamp bounds read from the
# action space's NumPy arrays; C51's projection with a Python loop of index_add_ and its
# target network loaded from the online one inside the step. Both ran already: guards.
TD3_C51 = """
import copy


class QNetwork(nn.Module):
    def __init__(self, obs, act, out=1):
        super().__init__()
        self.fc1 = nn.Linear(obs + act, 32)
        self.fc2 = nn.Linear(32, out)

    def forward(self, x, a):
        return self.fc2(F.relu(self.fc1(torch.cat([x, a], 1))))


class Actor(nn.Module):
    def __init__(self, obs, act):
        super().__init__()
        self.fc1 = nn.Linear(obs, 32)
        self.fc_mu = nn.Linear(32, act)
        self.register_buffer("action_scale", torch.full((act,), 2.0))
        self.register_buffer("action_bias", torch.zeros(act))

    def forward(self, x):
        x = F.relu(self.fc1(x))
        return torch.tanh(self.fc_mu(x)) * self.action_scale + self.action_bias


torch.manual_seed(0)
actor, qf1, qf2 = Actor(3, 2), QNetwork(3, 2), QNetwork(3, 2)
target_actor, qf1_target = copy.deepcopy(actor), copy.deepcopy(qf1)
qf2_target = copy.deepcopy(qf2)
q_optimizer = optim.Adam(list(qf1.parameters()) + list(qf2.parameters()), lr=3e-4)
actor_optimizer = optim.Adam(list(actor.parameters()), lr=3e-4)


def td3_update(data, global_step):
    with torch.no_grad():
        clipped_noise = (torch.randn_like(data.actions, device=device) * args.policy_noise).clamp(
            -args.noise_clip, args.noise_clip
        ) * target_actor.action_scale

        next_state_actions = (target_actor(data.next_observations) + clipped_noise).clamp(
            envs.single_action_space.low[0], envs.single_action_space.high[0]
        )
        qf1_next_target = qf1_target(data.next_observations, next_state_actions)
        qf2_next_target = qf2_target(data.next_observations, next_state_actions)
        min_qf_next_target = torch.min(qf1_next_target, qf2_next_target)
        next_q_value = data.rewards.flatten() + (1 - data.dones.flatten()) * args.gamma * (
            min_qf_next_target
        ).view(-1)

    qf1_a_values = qf1(data.observations, data.actions).view(-1)
    qf2_a_values = qf2(data.observations, data.actions).view(-1)
    qf1_loss = F.mse_loss(qf1_a_values, next_q_value)
    qf2_loss = F.mse_loss(qf2_a_values, next_q_value)
    qf_loss = qf1_loss + qf2_loss

    q_optimizer.zero_grad()
    qf_loss.backward()
    q_optimizer.step()

    if global_step % args.policy_frequency == 0:
        actor_loss = -qf1(data.observations, actor(data.observations)).mean()
        actor_optimizer.zero_grad()
        actor_loss.backward()
        actor_optimizer.step()

        for param, target_param in zip(actor.parameters(), target_actor.parameters()):
            target_param.data.copy_(args.tau * param.data + (1 - args.tau) * target_param.data)
        for param, target_param in zip(qf1.parameters(), qf1_target.parameters()):
            target_param.data.copy_(args.tau * param.data + (1 - args.tau) * target_param.data)
        for param, target_param in zip(qf2.parameters(), qf2_target.parameters()):
            target_param.data.copy_(args.tau * param.data + (1 - args.tau) * target_param.data)
    return qf_loss.item()


class C51Network(nn.Module):
    def __init__(self, n_atoms=11, v_min=-10, v_max=10):
        super().__init__()
        self.n_atoms = n_atoms
        self.register_buffer("atoms", torch.linspace(v_min, v_max, steps=n_atoms))
        self.n = 2
        self.network = nn.Sequential(nn.Linear(3, 32), nn.ReLU(), nn.Linear(32, self.n * n_atoms))

    def get_action(self, x, action=None):
        logits = self.network(x)
        pmfs = torch.softmax(logits.view(len(x), self.n, self.n_atoms), dim=2)
        q_values = (pmfs * self.atoms).sum(2)
        if action is None:
            action = torch.argmax(q_values, 1)
        return action, pmfs[torch.arange(len(x)), action]


q_network, target_network = C51Network(), C51Network()
target_network.load_state_dict(q_network.state_dict())
optimizer = optim.Adam(q_network.parameters(), lr=2.5e-4, eps=0.01 / 32)


def c51_update(data, global_step):
    with torch.no_grad():
        _, next_pmfs = target_network.get_action(data.next_observations)
        next_atoms = data.rewards + args.gamma * target_network.atoms * (1 - data.dones)
        delta_z = target_network.atoms[1] - target_network.atoms[0]
        tz = next_atoms.clamp(args.v_min, args.v_max)

        b = (tz - args.v_min) / delta_z
        l = b.floor().clamp(0, args.n_atoms - 1)
        u = b.ceil().clamp(0, args.n_atoms - 1)
        d_m_l = (u + (l == u).float() - b) * next_pmfs
        d_m_u = (b - l) * next_pmfs
        target_pmfs = torch.zeros_like(next_pmfs)
        for i in range(target_pmfs.size(0)):
            target_pmfs[i].index_add_(0, l[i].long(), d_m_l[i])
            target_pmfs[i].index_add_(0, u[i].long(), d_m_u[i])

    _, old_pmfs = q_network.get_action(data.observations, data.actions.flatten())
    loss = (-(target_pmfs * old_pmfs.clamp(min=1e-5, max=1 - 1e-5).log()).sum(-1)).mean()

    optimizer.zero_grad()
    loss.backward()
    optimizer.step()

    if global_step % args.target_network_frequency == 0:
        target_network.load_state_dict(q_network.state_dict())
    return loss.item()
"""

Samples = collections.namedtuple(
    "ReplayBufferSamples", "observations actions next_observations dones rewards"
)


def td3_c51_run(jit: bool) -> tuple[list, dict]:
    g = script(
        TD3_C51, policy_noise=0.2, noise_clip=0.5, gamma=0.99, tau=0.005, policy_frequency=2,
        v_min=-10, v_max=10, n_atoms=11, target_network_frequency=3,
    )  # fmt: skip
    space = types.SimpleNamespace(
        low=np.full(2, -2.0, np.float32), high=np.full(2, 2.0, np.float32)
    )
    g.update(device="cpu", envs=types.SimpleNamespace(single_action_space=space))
    td3, c51 = g["td3_update"], g["c51_update"]
    if jit:
        names = ("actor", "qf1", "qf2", "target_actor", "qf1_target", "qf2_target")
        td3 = functacc.jit(
            td3, modules=[g[k] for k in names],
            optimizers=[g["q_optimizer"], g["actor_optimizer"]], backend="eager",
        )  # fmt: skip
        c51 = functacc.jit(
            c51, modules=[g["q_network"], g["target_network"]], optimizers=[g["optimizer"]],
            backend="eager",
        )  # fmt: skip
    data, losses = torch.Generator().manual_seed(1), []
    torch.manual_seed(3)  # TD3's target policy noise
    for global_step in range(1, 8):
        obs, next_obs = torch.randn(16, 3, generator=data), torch.randn(16, 3, generator=data)
        dones = (torch.rand(16, 1, generator=data) < 0.1).float()
        rewards = torch.randn(16, 1, generator=data)
        actions = torch.randn(16, 2, generator=data)
        losses.append(td3(Samples(obs, actions, next_obs, dones, rewards), global_step))
        discrete = torch.randint(0, 2, (16, 1), generator=data)
        losses.append(c51(Samples(obs, discrete, next_obs, dones, rewards), global_step))
    names = ("actor", "qf1", "target_actor", "qf2_target", "q_network", "target_network")
    return losses, {k: g[k].state_dict() for k in names}


def test_cleanrl_td3_and_c51_updates_as_written_run_as_in_eager() -> None:
    (got, trained), (expected, reference) = td3_c51_run(True), td3_c51_run(False)
    assert got == expected and len(got) == 14
    for k, state in trained.items():
        for (n, a), b in zip(state.items(), reference[k].values(), strict=True):
            assert torch.equal(a, b), (k, n)


# nikhilbarhate99/PPO-PyTorch (tests/ppo_pytorch.py): the agent's own `update()` jitted as a
# bound method, `agent.update = functacc.jit(agent.update, ...)`. It reads its rollout
# buffer's lists as written: the rewards (floats) and terminal flags (bools) in a Python loop
# over `zip(reversed(...), reversed(...))`, `torch.tensor(rewards)`, `torch.stack` of the
# state, action, log-probability and value tensors; then copies the weights into
# `policy_old` and empties the buffer (`del self.rewards[:]`). Before 2026-11-28 that was a
# TraceError (torch.stack read the list in C++, unseen); a list of numbers read there or
# through `reversed()` was baked into the graph (silently: from the third update on, the
# first rollout's rewards), a list of tensors stacked so used its first length's items, and
# the continuous agent's MultivariateNormal failed on its covariance check.
def barhate_ppo_run(continuous: bool, jit: bool, updates: int = 4, horizon: int = 8) -> tuple:
    from ppo_pytorch import PPO

    torch.manual_seed(0)
    agent = PPO(4, 2, 3e-4, 1e-3, 0.99, 4, 0.2, continuous)
    if jit:
        agent.update = functacc.jit(
            agent.update, modules=[agent.policy, agent.policy_old],
            optimizers=agent.optimizer, backend="eager",
        )  # fmt: skip
    env = torch.Generator().manual_seed(3)
    for _ in range(updates):
        for _ in range(horizon):  # select_action as written (eager), a random environment
            agent.select_action(torch.randn(4, generator=env).tolist())
            agent.buffer.rewards.append(float(torch.rand((), generator=env)))
            agent.buffer.is_terminals.append(bool(torch.rand((), generator=env) < 0.15))
        agent.update()
        assert agent.buffer.states == [] and agent.buffer.rewards == []
    traces = agent.update.num_traces if jit else None
    return agent.policy.state_dict(), agent.policy_old.state_dict(), agent.optimizer, traces


@pytest.mark.parametrize("continuous", [False, True], ids=["discrete", "continuous"])
def test_ppo_pytorchs_update_reading_its_rollout_buffer_runs_as_in_eager(continuous: bool) -> None:
    policy, old, opt, traces = barhate_ppo_run(continuous, jit=True)
    ref_policy, ref_old, ref_opt, _ = barhate_ppo_run(continuous, jit=False)
    for k, v in ref_policy.items():
        assert torch.equal(policy[k], v) and torch.equal(old[k], ref_old[k]), k
    for p, q in zip(opt.state.values(), ref_opt.state.values(), strict=True):
        assert torch.equal(p["exp_avg_sq"], q["exp_avg_sq"])
    # The terminal flags are guarded (a trace per pattern: here every update's differs),
    # the rewards fed: no trace per value.
    assert traces <= 4
