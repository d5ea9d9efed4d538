"""What `estimate` and `simulate` share beyond the workload flags: the cost model flags, and turning
the command line into the engine config, the model's spec and this machine's step cost model (no
weights are loaded)."""

from __future__ import annotations


def add_cost_model_args(g) -> None:
    g.add_argument("--profile", default=None, metavar="PATH",
                   help="Calibration profile to use. [default: this machine's and model's from tokenmill "
                        "calibrate, if any]")
    g.add_argument("--roofline", action="store_true", help="Use the roofline model even if a profile exists.")
    g.add_argument("--json", action="store_true", help="One JSON object on stdout instead of tables.")


def planning_inputs(args, **overrides):
    """(engine config, SLO bounds in seconds, model spec, cost model choice) for a planning command;
    bad flags, an unknown model or a profile of another machine or model raise ConfigError here."""
    from tokenmill.entrypoints.cli.args import engine_config_from_args
    from tokenmill.entrypoints.cli.workload_args import check_workload_args, parse_slo_arg
    from tokenmill.planning.profile import cost_model_for

    check_workload_args(args)
    slo = parse_slo_arg(args.slo)
    config = engine_config_from_args(args, **overrides)
    spec, cost = cost_model_for(config, args.profile, args.roofline)
    return config, slo, spec, cost


def cost_model_json(cost) -> dict:
    return {"source": cost.model.source, "description": cost.description, "warnings": cost.warnings}
