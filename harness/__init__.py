"""dtbench core (``dtbench.harness``): suites, data, models, registry, runner, measurement, database, one room per
concern (docs/architecture.md). Importing it installs the plugin registry's import guard
(:func:`dtbench.harness.execution.plugin_probe.install`): plugins' imports are tried in a killable child first."""

from dtbench.harness.execution.plugin_probe import install

install()
