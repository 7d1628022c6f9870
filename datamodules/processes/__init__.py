"""How our processes end, stop and lock: the tools' exit contract, loader workers' signals and forks, file locks."""
