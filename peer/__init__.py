"""dtfm.peer"""
