"""The trainer (torchtitan's, subclassed), its TOML config, compile caps, pre-launch validation
and the per-microbatch sequence preprocessor."""
