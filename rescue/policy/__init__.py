"""The policy side of the wire: the openpi websocket protocol (msgpack with numpy arrays), its client, its server for any in-process policy factory."""
