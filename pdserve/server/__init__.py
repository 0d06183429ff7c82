"""pdserve.server"""
