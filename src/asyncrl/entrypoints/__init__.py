"""Console entrypoints, one thin module each: parse the config, set up logging, call the component."""
