"""Tools around the engine: `verify` (losslessness on the user's prompts), `tune` (which drafter and lengths pay
here, written to a config file) and `report` (a self-contained HTML page of what speculation did)."""
