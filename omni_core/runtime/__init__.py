"""The runtime: runner and coordinator (parent), stage host (child), control plane, launchers."""
