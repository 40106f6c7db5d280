{{/* Prefix of object names: "kelastic" unless overridden (deploy/ uses the default). */}}
{{- define "kelastic.fullname" -}}
{{- default "kelastic" .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- end -}}

{{- define "kelastic.operatorName" -}}{{ include "kelastic.fullname" . }}-operator{{- end -}}
{{- define "kelastic.etcdName" -}}{{ include "kelastic.fullname" . }}-etcd{{- end -}}

{{- define "kelastic.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{- define "kelastic.sidecarImage" -}}
{{- default (include "kelastic.image" .) .Values.sidecar.image -}}
{{- end -}}

{{/* Labels Helm adds on top of deploy/'s (ignored when deploy/ and the chart are compared). */}}
{{- define "kelastic.helmLabels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
{{- end -}}

{{/* The default etcd endpoints the operator hands to jobs that name none. */}}
{{- define "kelastic.etcdEndpoints" -}}
{{- if .Values.etcd.bundled -}}
{{- printf "%s.%s.svc:2379" (include "kelastic.etcdName" .) .Release.Namespace -}}
{{- else -}}
{{- join "," .Values.etcd.external.endpoints -}}
{{- end -}}
{{- end -}}
