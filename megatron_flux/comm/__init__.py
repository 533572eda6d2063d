"""Communication plumbing for the fused backend: symmetric workspaces, signal writes from the
host side, and the device error word that turns a timed-out wait into an exception."""
