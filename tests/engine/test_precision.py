import torch

from lomo_ds.engine.precision import DynamicLossScaler, stochastic_round_to_bf16
from lomo_ds.engine.schedule import Schedule


def test_stochastic_rounding_tracks_fp32_where_nearest_stalls():
    # 2,000 updates of -1e-4 each to weights near 1.0: every update is far below half a bf16 ulp
    # (2^-8 = 0.0039 at 1.0), so round-to-nearest drops each one.
    torch.manual_seed(0)
    start = torch.full((4096,), 1.0)
    ref, nearest, stochastic = start.clone(), start.to(torch.bfloat16), start.to(torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    for _ in range(2000):
        ref -= 1e-4
        nearest = (nearest.float() - 1e-4).to(torch.bfloat16)
        stochastic = stochastic_round_to_bf16(stochastic.float() - 1e-4, gen)
    err_nearest = (nearest.float() - ref).abs().mean().item()
    err_stochastic = (stochastic.float() - ref).abs().mean().item()
    print(f"mean |w - fp32 reference| after 2000 steps: round-to-nearest {err_nearest:.4f}, "
          f"stochastic {err_stochastic:.4f} (fp32 moved {1 - ref[0].item():.4f})")
    assert torch.equal(nearest.float(), start)  # stalled
    assert err_nearest > 0.19
    # Each weight random-walks around the reference (std ~ ulp * sqrt(steps * p)); the mean does not drift.
    assert err_stochastic < 0.05
    assert abs(stochastic.float().mean().item() - ref.mean().item()) < 0.003


def test_stochastic_rounding_is_unbiased_and_exact_on_representable_values():
    gen = torch.Generator().manual_seed(1)
    x = torch.full((200_000,), 1.0 + 2**-10)  # a quarter of the way from 1.0 to the next bf16 value
    r = stochastic_round_to_bf16(x, gen).float()
    assert set(r.unique().tolist()) == {1.0, 1.0 + 2**-7}
    assert abs(r.mean().item() - x[0].item()) < 2e-5
    exact = torch.tensor([0.5, -3.0, 0.0, float("inf"), -float("inf")])
    assert torch.equal(stochastic_round_to_bf16(exact, gen).float(), exact)
    assert torch.isnan(stochastic_round_to_bf16(torch.tensor([float("nan")]), gen)).all()
    neg = stochastic_round_to_bf16(-x, gen).float()
    assert abs(neg.mean().item() + x[0].item()) < 2e-5


def test_loss_scaler_halves_on_overflow_and_grows_back():
    s = DynamicLossScaler(scale=1024.0, window=3, min_scale=1.0)
    s.update(overflow=True)
    assert s.scale == 512.0
    for _ in range(2):
        s.update(overflow=False)
    assert s.scale == 512.0
    s.update(overflow=False)
    assert s.scale == 1024.0
    for _ in range(20):
        s.update(overflow=True)
    assert s.scale == 1.0  # floor
    restored = DynamicLossScaler()
    restored.load_state_dict(s.state_dict())
    assert restored.scale == s.scale and restored.clean_steps == s.clean_steps


def test_schedules():
    const = Schedule("constant", 0.1)
    assert const.lr_at(0) == const.lr_at(1000) == 0.1
    lin = Schedule("linear", 0.1, total_steps=110, warmup_steps=10)
    assert lin.lr_at(0) == 0.1 / 10 and lin.lr_at(9) == 0.1
    assert abs(lin.lr_at(60) - 0.05) < 1e-12 and lin.lr_at(110) == 0.0
    cos = Schedule("cosine", 0.1, total_steps=110, warmup_steps=10)
    assert abs(cos.lr_at(60) - 0.05) < 1e-12 and abs(cos.lr_at(110)) < 1e-12
    assert cos.lr_at(30) > lin.lr_at(30)
