"""dtfm.scenarios: the DT-FM paper's five network scenarios, as data (TOML files beside this
module), and their loader. The scheduler, the link emulator and `dtfm-swarm` all read them."""

from .load import Region, Scenario, ScenarioError, builtin_scenarios, load_scenario, parse_scenario

__all__ = ["Region", "Scenario", "ScenarioError", "builtin_scenarios", "load_scenario", "parse_scenario"]
