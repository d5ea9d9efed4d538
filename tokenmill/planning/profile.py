"""Calibration profiles: a fitted cost model saved as JSON with the machine and model it was measured
on, and the choice between a profile and the roofline fallback.

A profile for another machine or model is an error (its numbers would be silently wrong); a stale
one (other tokenmill or torch version, or older than STALE_AFTER_DAYS) warns and falls back to
the roofline, since kernels and the engine's overheads change between versions.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

from tokenmill import __version__
from tokenmill.errors import ConfigError
from tokenmill.model.loader.cache import cache_root
from tokenmill.planning.cost_model import StepCostModel
from tokenmill.planning.machine import MachineMeasurements, machine_measurements
from tokenmill.planning.model_spec import ModelSpec
from tokenmill.planning.roofline import roofline_model

logger = logging.getLogger(__name__)

PROFILE_FORMAT = 1
STALE_AFTER_DAYS = 30


def _torch_version() -> str:
    import torch

    return torch.__version__


@dataclass
class Profile:
    machine: dict
    model: dict
    cost_model: StepCostModel
    measurements: MachineMeasurements | None = None
    calibration: dict = field(default_factory=dict)  # errors, measured points, duration
    tokenmill_version: str = __version__
    torch_version: str = field(default_factory=_torch_version)
    created: str = field(default_factory=lambda: dt.datetime.now(dt.UTC).isoformat(timespec="seconds"))
    format: int = PROFILE_FORMAT

    def to_dict(self) -> dict:
        return {"format": self.format, "tokenmill_version": self.tokenmill_version,
                "torch_version": self.torch_version, "created": self.created, "machine": self.machine,
                "model": self.model, "cost_model": self.cost_model.to_dict(),
                "measurements": self.measurements.to_dict() if self.measurements else None,
                "calibration": self.calibration}

    @classmethod
    def from_dict(cls, d: dict) -> Profile:
        m = d.get("measurements")
        return cls(machine=dict(d["machine"]), model=dict(d["model"]),
                   cost_model=StepCostModel.from_dict(d["cost_model"]),
                   measurements=MachineMeasurements(m["bandwidth"], m["flops"]) if m else None,
                   calibration=d.get("calibration") or {}, tokenmill_version=d["tokenmill_version"],
                   torch_version=d["torch_version"], created=d["created"], format=d["format"])

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=1))
        tmp.replace(path)


def load_profile(path: Path) -> Profile:
    try:
        return Profile.from_dict(json.loads(Path(path).read_text()))
    except OSError as e:
        raise ConfigError(f"cannot read profile {path}: {e.strerror or e}") from None
    except (ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"{path} is not a tokenmill calibration profile ({type(e).__name__}: {e})") from None


def default_profile_path(machine: dict, model: dict) -> Path:
    key = hashlib.sha256(json.dumps([machine, model], sort_keys=True).encode()).hexdigest()[:16]
    return cache_root() / "profiles" / f"{model['name']}-{model['dtype']}-{key}.json"


def mismatches(profile: Profile, machine: dict, model: dict) -> list[str]:
    """Why a profile does not describe this machine and model (empty: it does)."""
    out = []
    for what, have, want in (("machine", profile.machine, machine), ("model", profile.model, model)):
        for k in sorted(set(have) | set(want)):
            if k != "name" and have.get(k) != want.get(k):
                out.append(f"{what} {k}: profile {have.get(k)!r}, here {want.get(k)!r}")
    return out


def staleness(profile: Profile, now: dt.datetime | None = None) -> list[str]:
    out = []
    if profile.format != PROFILE_FORMAT:
        out.append(f"profile format {profile.format}, this tokenmill writes {PROFILE_FORMAT}")
    if profile.tokenmill_version != __version__:
        out.append(f"made by tokenmill {profile.tokenmill_version}, this is {__version__}")
    if profile.torch_version != _torch_version():
        out.append(f"made with torch {profile.torch_version}, this is {_torch_version()}")
    try:
        age = (now or dt.datetime.now(dt.UTC)) - dt.datetime.fromisoformat(profile.created)
        if age > dt.timedelta(days=STALE_AFTER_DAYS):
            out.append(f"{age.days} days old (recalibrate after {STALE_AFTER_DAYS})")
    except (ValueError, TypeError):
        out.append(f"unreadable creation date {profile.created!r}")
    return out


@dataclass
class CostModelChoice:
    model: StepCostModel | None  # None: a roofline not measured yet (choose_cost_model)
    description: str  # for the report: which model, from where, how accurate
    profile_path: Path | None = None
    warnings: list[str] = field(default_factory=list)


def choose_cost_model(spec: ModelSpec, machine: dict, profile_path: str | None = None, roofline: bool = False,
                      model_arg: str | None = None, measure: bool = True) -> CostModelChoice:
    """The calibrated profile for this machine and model (--profile or the default location), else the
    roofline. A profile for another machine or model raises; a stale one warns and falls back.
    Reads no weights: callers check a profile before anything slow. With `measure` False a roofline
    choice comes without its model (None): `roofline_choice` measures the machine later, when nothing
    else of ours runs (a server's core process loading beside the measurement halved it)."""
    model = spec.fingerprint()
    flags = " ".join(f for f in (model_arg and f"--model {model_arg}", f"--dtype {spec.dtype}",
                                 f"--num-threads {machine['num_threads']}") if f)
    hint = f"run `tokenmill calibrate {flags}` on this machine"
    warnings: list[str] = []
    path = Path(profile_path).expanduser() if profile_path else default_profile_path(machine, model)
    if not roofline and (profile_path or path.is_file()):
        profile = load_profile(path)
        wrong = mismatches(profile, machine, model)
        if wrong:
            raise ConfigError(f"profile {path} was calibrated for {profile.model.get('name')} on "
                              f"{profile.machine.get('cpu')}, not for this machine and model ({'; '.join(wrong)}): "
                              f"{hint}")
        stale = staleness(profile)
        if not stale:
            err = profile.calibration.get("held_out_error_pct", {})
            acc = f", held-out error {err['median']:.1f}% median / {err['max']:.1f}% max" if err else ""
            return CostModelChoice(profile.cost_model, f"calibrated profile {path} ({profile.created}{acc})", path)
        warnings.append(f"profile {path} is stale ({'; '.join(stale)}): falling back to the roofline model; {hint}")
    elif not roofline:
        warnings.append(f"no calibration profile for this machine and model: using the roofline model "
                        f"(optimistic); {hint}")
    for w in warnings:
        logger.warning("%s", w)
    if not measure:
        return CostModelChoice(None, "roofline (not measured yet)", None, warnings)
    return roofline_choice(spec, machine, warnings)


def roofline_choice(spec: ModelSpec, machine: dict, warnings: list[str] | None = None) -> CostModelChoice:
    m = machine_measurements(machine)
    desc = (f"roofline from measured {m.bandwidth / 1e9:.1f} GB/s and "
            f"{(m.flops.get(spec.dtype) or max(m.flops.values())) / 1e12:.2f} TFLOP/s ({spec.dtype})")
    return CostModelChoice(roofline_model(spec, m), desc, None, warnings or [])


def cost_model_for(config, profile_path: str | None = None, roofline: bool = False, measure: bool = True
                   ) -> tuple[ModelSpec, CostModelChoice]:
    """What estimate, simulate and serve --slo plan with: the model as `config` stores it (no weights
    loaded) and the step cost model of this machine for it."""
    from tokenmill.planning.machine import machine_of
    from tokenmill.planning.model_spec import model_spec

    spec = model_spec(config)
    return spec, choose_cost_model(spec, machine_of(config), profile_path, roofline, config.model.model, measure)
