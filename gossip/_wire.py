"""The peer layer's codec and field checkers, as used by gossip messages."""

from dtfm.net import ProtocolError, get_bool, get_bytes, get_float, get_int, get_list, get_str, pack, unpack_untrusted

__all__ = ["ProtocolError", "pack", "unpack_untrusted", "get_int", "get_float", "get_str",
           "get_bytes", "get_list", "get_bool"]
