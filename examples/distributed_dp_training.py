import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset, default_collate

import opake_fx.accounting as acc
import opake_fx.dpsgd.accounting as dpsgd_acc
from opake_fx.dpsgd.clipping import clipped_grad
from opake_fx.dpsgd.noise import gaussian_noise
from opake_fx.dpsgd.sampling import PoissonSampler
from opake_fx.functional import empty_collate, make_functional
from opake_fx.distributed.gradients import sum_gradients_
from opake_fx.random import key, fold_in
from opake_fx.distributed import local_shard

# Initialize distributed (set by torchrun)
dist.init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo")
rank = dist.get_rank()
world_size = dist.get_world_size()
device = torch.device(f"cuda:{rank}" if torch.cuda.is_available() else "cpu")
if device.type == "cuda":
    torch.cuda.set_device(device)

print(f"Rank {rank}/{world_size} on {device}")

torch.manual_seed(42)

# Synthetic dataset (same on all ranks)
dataset_size = 10_000
X = torch.randn(dataset_size, 20)
y = (X[:, 0] + X[:, 1] > 0).float()
dataset = TensorDataset(X, y)


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(20, 64)
        self.fc2 = nn.Linear(64, 1)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x))).squeeze(-1)


model = MLP().to(device)
fmodel, params = make_functional(model)

BATCH_SIZE = 64
NUM_STEPS = 500
TARGET_EPS = 3.0
DELTA = 1e-5
LR = 0.1

sample_rate = BATCH_SIZE / dataset_size

# Calibrate noise multiplier
result = acc.calibrate(
    acc.epsilon_budget(TARGET_EPS, delta=DELTA),
    lambda nm: dpsgd_acc.poisson(dpsgd_acc.gaussian(nm), sample_rate) * NUM_STEPS,
    param_min=0.1,
    param_max=10.0,
)
noise_multiplier = result.param

if rank == 0:
    print(f"Noise multiplier: {noise_multiplier:.4f}")


# Loss function
def loss_fn(params, x, y):
    logit = fmodel(params, x.unsqueeze(0)).squeeze()
    return F.binary_cross_entropy_with_logits(logit, y)


# Clipped gradient function
grad_fn, clip_state = clipped_grad(
    loss_fn,
    argnums=0,
    batch_argnums=(1, 2),
    clipping_norm=1.0,
    normalize_by=BATCH_SIZE,
)

# Noise function — same key on all ranks => identical noise
noise_fn, noise_state = gaussian_noise(
    noise_multiplier=noise_multiplier,
    key=key(42),
)

# Shard dataset and create per-rank sampler
shard = local_shard(dataset, rank=rank, world_size=world_size)
sampler = PoissonSampler(
    shard,
    sample_rate=sample_rate,
    n_steps=NUM_STEPS,
    key=fold_in(key(0), rank),
)
collate = empty_collate(default_collate)
collate([shard[0]])
loader = DataLoader(shard, batch_sampler=sampler, collate_fn=collate)

for step, (xb, yb) in enumerate(loader):
    if step >= NUM_STEPS:
        break

    xb, yb = xb.to(device), yb.to(device)

    # 1. Per-example clipped gradients (local data only)
    grads, clip_state = grad_fn(params, xb, yb, state=clip_state)

    # 2. Sum clipped gradients across all ranks (in-place)
    sum_gradients_(grads)

    # 3. Add noise (identical on all ranks); noisy_grads is a NoisedPytree
    noisy_grads, noise_state = noise_fn(grads, noise_state)

    # 4. SGD update — unwrap .pytree for the raw tensor leaves
    params = tuple(p - LR * g for p, g in zip(params, noisy_grads.pytree))

    if rank == 0 and (step + 1) % 100 == 0:
        with torch.no_grad():
            loss = loss_fn(params, xb[0], yb[0]).item() if len(xb) else float("nan")
        eps = (
            dpsgd_acc.poisson(dpsgd_acc.gaussian(noise_multiplier), sample_rate) * (step + 1)
        ).epsilon_at(DELTA)
        print(f"Step {step + 1:4d}  loss={loss:.4f}  epsilon={eps:.2f}")

if rank == 0:
    eps_final = (
        dpsgd_acc.poisson(dpsgd_acc.gaussian(noise_multiplier), sample_rate) * NUM_STEPS
    ).epsilon_at(DELTA)
    print(f"\nFinal epsilon: {eps_final:.2f}")

dist.destroy_process_group()
