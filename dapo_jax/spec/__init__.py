"""From the command line to a validated run: the shared override syntax (`cli`), batch-size
rules, the typed run spec read once from the config, and the relaunch contract."""
