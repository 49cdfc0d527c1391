"""What the controller records (layer 2): the run store, the collector of metric events, rollups and steps per
second. Imports the runtime and the base modules, nothing above."""
