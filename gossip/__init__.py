"""dtfm.gossip"""
