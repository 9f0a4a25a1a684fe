package admin

import "net/http"

func (s *Server) page(mux *http.ServeMux) {}
