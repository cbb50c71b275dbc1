"""rescue-serve: serve a robot policy over openpi's websocket protocol, with rescue's extensions.

A small distribution of its own (numpy, msgpack and websockets only), so it installs into
the policy's environment (LeRobot's, openpi's) while the simulator side runs elsewhere.
`rescue serve-policy` runs this same code.
"""

__version__ = "0.1.0"
